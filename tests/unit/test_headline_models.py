"""benchmarks/headline.py keeps its model folders outside the output dir, one path per content.

vLLM 0.33 hashes the model's path (``ModelConfig.compute_hash``: ``model`` is not among its
ignored factors) and the drafter's (``SpeculativeConfig.compute_hash`` hashes its model config)
into the torch.compile cache key. Seen on a GPU: a second run of the same arm with another output
dir compiled its backbone afresh (25 s), its folders having been written under that dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import headline as hl  # noqa: E402
import model_folders  # noqa: E402


def _paths(arm) -> tuple[str, str]:
    return arm.kwargs["model"], arm.kwargs["speculative_config"]["model"]


def test_two_output_dirs_run_the_same_model_paths(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(hl, "run_arm", lambda arm, *a, **k: ran.append(_paths(arm)) or {"booted": True})
    monkeypatch.setattr(hl, "save_all", lambda out: [])
    models = tmp_path / "models"
    for out in (tmp_path / "run1", tmp_path / "run2"):
        hl.run_launcher("fp8-dflash2", out, {"plugin"}, 140.0, hl.VIRTUAL, models=models)
    assert len(ran) == 2 and ran[0] == ran[1]
    model, drafter = map(Path, ran[0])
    assert model.parent == models and drafter.parent == models
    assert json.loads((model / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert (drafter / "config.json").read_text() == hl.DRAFTER_CONFIG.read_text()


def test_same_content_same_path_other_content_another(tmp_path):
    root = tmp_path / "models"
    first = hl.kept_folder(root, "dflash2-drafter", hl.write_drafter)
    again = hl.kept_folder(root, "dflash2-drafter", hl.write_drafter)
    other = hl.kept_folder(root, "dflash2-drafter", lambda d: (d / "config.json").write_text("{}"))
    assert first == again != other
    assert (other / "config.json").read_text() == "{}"
    assert sorted(p.name for p in root.iterdir()) == sorted({first.name, other.name})  # no temporary folder left


def test_the_default_models_folder_is_the_users_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hl.build_parser().parse_args(["out"]).models == tmp_path / "xdg" / "vllm-dualgpu" / "headline-models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_folders.default_models_dir() == tmp_path / "home" / ".cache" / "vllm-dualgpu" / "headline-models"
    assert hl.build_parser().parse_args(["out", "--models", "m"]).models == Path("m")


def test_dry_run_writes_its_models_under_models(tmp_path, monkeypatch, capsys):
    out, models = tmp_path / "out", tmp_path / "models"
    monkeypatch.setattr(sys, "argv", ["headline.py", str(out), "--dry-run", "--launchers", "fp8-dflash2",
                                      "--models", str(models)])
    assert hl.main() == 0
    arms = json.loads(capsys.readouterr().out)
    assert arms and {Path(p).parent for a in arms for p in _paths(hl.Arm(**a))} == {models}
    assert not (out / "models").exists()


def test_an_arms_file_name_keeps_to_letters_digits_dash_and_underscore():
    """A shorter-context arm is named "plugin@N"; its files must not carry the '@' (file tools and
    result transfers refuse odd characters in names)."""
    import re

    arm = hl.Arm("w8a16-dflash2/plugin@241664", "plugin", "w8a16-dflash2", {}, {})
    assert arm.file == "w8a16-dflash2_plugin-at-241664"
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", arm.file)


def test_a_later_call_finds_the_plugin_arms_split_at_a_shorter_context(tmp_path):
    """The split arms start from the plugin arm's split, read from its result file (this call's or
    an earlier one's): under the file name the arm was written with."""
    arm = hl.Arm("w8a16-dflash2/plugin@241664", "plugin", "w8a16-dflash2", {}, {})
    (tmp_path / "arms").mkdir()
    (tmp_path / "arms" / f"{arm.file}.json").write_text(json.dumps({"partition": [19, 45]}))
    assert hl.plugin_split(tmp_path, "w8a16-dflash2", 241_664) == [19, 45]
    assert hl.plugin_split(tmp_path, "w8a16-dflash2") is None  # the 262,144 arm has not run


def test_a_reserve_applies_to_the_plugin_and_split_arms_only_and_names_them(tmp_path, monkeypatch, capsys):
    """--reserve runs the plugin (and the split arms) with VLLM_DUALGPU_RESERVE as a refusal names
    it; the expert keeps its own flags, and the arms' names (and files) say which reserve ran."""
    import re

    out, models = tmp_path / "out", tmp_path / "models"
    monkeypatch.setattr(sys, "argv", ["headline.py", str(out), "--dry-run", "--launchers", "w8a16-dflash2",
                                      "--arms", "expert,plugin,split", "--models", str(models),
                                      "--reserve", "256MiB,736MiB"])
    assert hl.main() == 0
    arms = {a["name"]: a for a in json.loads(capsys.readouterr().out)}
    plugin = arms["w8a16-dflash2/plugin-reserve-256MiB,736MiB"]
    assert plugin["env"]["VLLM_DUALGPU_RESERVE"] == "256MiB,736MiB"
    assert "VLLM_DUALGPU_RESERVE" not in arms["w8a16-dflash2/expert"]["env"]
    splits = [a for a in arms.values() if a["kind"] == "split"]
    assert splits and all(a["env"]["VLLM_DUALGPU_RESERVE"] == "256MiB,736MiB" for a in splits)
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", hl.Arm(**plugin).file)


def test_a_bad_reserve_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["headline.py", str(tmp_path), "--dry-run", "--reserve", "lots"])
    with pytest.raises(SystemExit) as e:
        hl.main()
    assert e.value.code == 2 and "VLLM_DUALGPU_RESERVE" in capsys.readouterr().err
