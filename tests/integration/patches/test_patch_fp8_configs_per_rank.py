"""Block-FP8 config lookup: file names, search order, per-rank names, the registered patch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from vllm_dualgpu import rank_summary
from vllm_dualgpu.kernels import fp8_configs as fc

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = ROOT / "kernel_configs"
SEED_SHAPES = {(14336, 5120), (16384, 5120), (34816, 5120), (5120, 17408), (5120, 6144)}
RTX = "NVIDIA GeForce RTX 4070 Ti SUPER"
RTX_FILE = "NVIDIA_GeForce_RTX_4070_Ti_SUPER"


@pytest.fixture(autouse=True)
def clean_state():
    fc.reset_for_tests()
    rank_summary.clear()
    yield
    fc.reset_for_tests()
    rank_summary.clear()


@pytest.fixture
def gpus(monkeypatch):
    """Fake CUDA: a list of card names, a settable current device, initialised or not."""

    class Gpus:
        names = ["NVIDIA H200", RTX]
        current = 0
        initialized = True

    g = Gpus()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: g.initialized)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: g.current)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: g.names[g.current if i is None else i])
    return g


def write_cfg(folder: Path, N: int, K: int, device: str, body: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    body = body or {"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
                          "num_warps": 4, "num_stages": 3}}
    p = folder / fc.config_file_name(N, K, device)
    p.write_text(json.dumps(body))
    return p


# ---- names --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [RTX, "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "Tesla V100/PCIe  16GB",
                                  "NVIDIA RTX\t6000 Ada Generation", "AMD Instinct MI300X"])
def test_file_name_form_is_vllms(monkeypatch, name):
    from vllm.platforms import current_platform
    from vllm.utils.platform_utils import get_device_name_as_file_name

    monkeypatch.setattr(type(current_platform), "get_device_name", classmethod(lambda cls, device_id=0: name))
    assert fc.device_name_as_file_name(name) == get_device_name_as_file_name.__wrapped__(0)


def test_file_name_round_trip_and_vllm_spelling():
    name = fc.config_file_name(14336, 5120, RTX_FILE)
    assert name == f"N=14336,K=5120,device_name={RTX_FILE},dtype=fp8_w8a8,block_shape=[128,128].json"
    key = fc.parse_config_file_name(name)
    assert key == fc.ConfigFileKey(14336, 5120, RTX_FILE, "fp8_w8a8", 128, 128)
    odd = fc.parse_config_file_name("N=7,K=9,device_name=A,B_C,dtype=int8_w8a8,block_shape=[64, 32].json")
    assert (odd.device_name, odd.dtype, odd.block_n, odd.block_k) == ("A,B_C", "int8_w8a8", 64, 32)
    for bad in ("README.md", "N=1,K=2,device_name=X,dtype=fp8_w8a8.json",
                "E=8,N=1,K=2,device_name=X,dtype=fp8_w8a8,block_shape=[128,128].json"):
        assert fc.parse_config_file_name(bad) is None


def test_vllm_own_folder_uses_the_same_names():
    """Every block-FP8 file vLLM ships parses (so our name builder matches its convention)."""
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    folder = Path(fp8_utils.__file__).parent / "configs"
    names = [p.name for p in folder.glob("N=*,block_shape=*.json") if "dtype=fp8_w8a8" in p.name]
    assert names
    for n in names:
        k = fc.parse_config_file_name(n)
        assert k is not None and fc.config_file_name(k.N, k.K, k.device_name, k.block_n, k.block_k) == n


# ---- shipped files --------------------------------------------------------------------------


def test_shipped_configs_are_the_seed_set_and_valid():
    files = fc.list_config_files(SHIPPED)
    rtx = {(k.N, k.K) for k, _ in files if k.device_name == RTX_FILE}
    assert rtx == SEED_SHAPES
    for key, path in files:
        configs = fc.load_config_file(path, key.block_k)
        assert 1 in configs and all(isinstance(m, int) for m in configs)
    readme = (SHIPPED / "README.md").read_text()
    assert "ExTV/dual-gpus-vllm" in readme and "2b33255f2f0ce4be123e8c283ec314a96d140b65" in readme
    assert "Apache-2.0" in readme


def test_package_folder_is_found_and_holds_the_shipped_files():
    """Editable or wheel install: the package's folder has every file of kernel_configs/."""
    found = fc.package_config_dir()
    shipped = {p.name: p.read_bytes() for p in SHIPPED.iterdir() if p.suffix in (".json", ".md")}
    installed = {p.name: p.read_bytes() for p in found.iterdir() if p.suffix in (".json", ".md")}
    assert len(shipped) >= 11 and installed == shipped


# ---- validation -----------------------------------------------------------------------------


def test_validation_rejects_what_the_kernel_cannot_run():
    good = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
            "num_warps": 4, "num_stages": 3}
    assert fc.validate_configs({"8": good}, 128) == {8: good}
    assert fc.validate_configs({"8": {**good, "BLOCK_SIZE_K": 64}}, 128)[8]["BLOCK_SIZE_K"] == 64
    for raw in ({}, [], {"x": good}, {"1": {**good, "BLOCK_SIZE_K": 256}},
                {"1": {k: v for k, v in good.items() if k != "num_warps"}}, {"1": {**good, "num_stages": 0}},
                {"1": {**good, "num_warps": "4"}}):
        with pytest.raises(fc.ConfigFileError):
            fc.validate_configs(raw, 128)


def test_pick_config_is_vllms_nearest_rule():
    configs = {1: "a", 8: "b", 64: "c", 512: "d"}
    for M in (1, 3, 4, 5, 36, 37, 100, 300, 5000):
        assert fc.pick_config(configs, M) == configs[min(configs.keys(), key=lambda x: abs(x - M))]
    assert fc.pick_config(configs, 36) == "b" and fc.pick_config(configs, 37) == "c"  # tie: first key


# ---- search order -----------------------------------------------------------------------------


def test_search_order_user_then_package_then_vllm(tmp_path, monkeypatch):
    user1, user2, pkg, vllm_dir = (tmp_path / n for n in ("u1", "u2", "pkg", "vllm"))
    monkeypatch.setattr(fc, "package_config_dir", lambda: pkg)
    monkeypatch.setenv(fc.ENV_USER_DIR, f"{user1}:{user2}")
    dirs = fc.search_dirs(vllm_dir)
    assert dirs == [(fc.USER, user1), (fc.USER, user2), (fc.PACKAGE, pkg), (fc.VLLM, vllm_dir)]

    write_cfg(vllm_dir, 10, 20, "CARD")
    expected = fc.Found(fc.VLLM, vllm_dir / fc.config_file_name(10, 20, "CARD"))
    assert fc.find_config(10, 20, 128, 128, "CARD", dirs)[0] == expected
    write_cfg(pkg, 10, 20, "CARD")
    assert fc.find_config(10, 20, 128, 128, "CARD", dirs)[0].source == fc.PACKAGE
    write_cfg(user2, 10, 20, "CARD")
    assert fc.find_config(10, 20, 128, 128, "CARD", dirs)[0].path.parent == user2
    write_cfg(user1, 10, 20, "CARD")
    assert fc.find_config(10, 20, 128, 128, "CARD", dirs)[0].path.parent == user1
    # Another card, another shape or another block: no file.
    assert fc.find_config(10, 20, 128, 128, "OTHER", dirs) is None
    assert fc.find_config(10, 21, 128, 128, "CARD", dirs) is None
    assert fc.find_config(10, 20, 64, 64, "CARD", dirs) is None


def test_unusable_file_is_skipped_for_the_next_folder(tmp_path, monkeypatch, caplog):
    user, pkg = tmp_path / "u", tmp_path / "pkg"
    monkeypatch.setattr(fc, "package_config_dir", lambda: pkg)
    monkeypatch.setenv(fc.ENV_USER_DIR, str(user))
    user.mkdir()
    (user / fc.config_file_name(10, 20, "CARD")).write_text("{not json")
    write_cfg(pkg, 10, 20, "CARD")
    with caplog.at_level(logging.WARNING, logger="vllm.dualgpu"):
        found, configs = fc.find_config(10, 20, 128, 128, "CARD", fc.search_dirs(None))
    assert found.source == fc.PACKAGE and 1 in configs
    assert any("ignoring block-FP8 config" in r.getMessage() for r in caplog.records)


# ---- per-rank lookup ----------------------------------------------------------------------------


def test_current_device_names_the_file(gpus):
    assert fc.current_device_file_name() == "NVIDIA_H200"
    gpus.current = 1
    assert fc.current_device_file_name() == RTX_FILE
    gpus.initialized = False
    assert fc.current_device_file_name() is None


def test_lookup_is_cached_per_card_and_records_the_source(tmp_path, monkeypatch, gpus):
    pkg = tmp_path / "pkg"
    monkeypatch.setattr(fc, "package_config_dir", lambda: pkg)
    monkeypatch.delenv(fc.ENV_USER_DIR, raising=False)
    write_cfg(pkg, 14336, 5120, RTX_FILE)
    assert fc.cached_lookup(14336, 5120, 128, 128, RTX_FILE, None)[1]["BLOCK_SIZE_M"] == 16
    assert fc.cached_lookup(14336, 5120, 128, 128, "NVIDIA_H200", None) is None
    # Cached: removing the file changes nothing for this process.
    (pkg / fc.config_file_name(14336, 5120, RTX_FILE)).unlink()
    assert fc.cached_lookup(14336, 5120, 128, 128, RTX_FILE, None) is not None
    assert fc.cached_lookup.cache_info().hits == 1
    assert fc.resolved()[(RTX_FILE, 14336, 5120, 128, 128)][0] == fc.PACKAGE
    assert fc.resolved()[("NVIDIA_H200", 14336, 5120, 128, 128)] == (fc.DEFAULT, None)
    note = rank_summary.facts()[fc.SUMMARY_KEY]
    assert f"{RTX_FILE}: package 14336x5120" in note and "NVIDIA_H200: default 14336x5120" in note


def test_one_info_line_per_rank_and_one_default_warning(tmp_path, monkeypatch, caplog):
    pkg = tmp_path / "pkg"
    monkeypatch.setattr(fc, "package_config_dir", lambda: pkg)
    monkeypatch.delenv(fc.ENV_USER_DIR, raising=False)
    for N in (1024, 2048):
        write_cfg(pkg, N, 512, "CARD")
    with caplog.at_level(logging.DEBUG, logger="vllm.dualgpu"):
        for N in (1024, 2048, 3072, 4096):
            fc.cached_lookup(N, 512, 128, 128, "CARD", None)
            fc.cached_lookup(N, 512, 128, 128, "CARD", None)
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    warns = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(infos) == 1 and "CARD" in infos[0].getMessage() and "N=1024" in infos[0].getMessage()
    assert fc.ENV_USER_DIR in infos[0].getMessage()  # says the user folder is unset
    assert len(warns) == 1 and "N=3072" in warns[0].getMessage()
    assert rank_summary.facts()[fc.SUMMARY_KEY] == "CARD: package 1024x512 2048x512; default 3072x512 4096x512"


# ---- the registered patch on vLLM's real function --------------------------------------------


@pytest.fixture
def patched_lookup():
    import vllm

    from vllm_dualgpu.patching.core import APPLIED, apply_patch, revert_patch
    from vllm_dualgpu.patching.registry import PATCHES

    p = next(p for p in PATCHES if p.name == "fp8-configs-per-rank")
    out = apply_patch(p, vllm.__version__)
    assert out.status == APPLIED, out.reason
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    yield fp8_utils
    assert revert_patch(p)


def test_patched_lookup_reads_each_ranks_own_card(patched_lookup, gpus, tmp_path, monkeypatch):
    fp8_utils = patched_lookup
    # The GEMM wrapper finds the lookup as a module global: it now reaches the replacement.
    assert fp8_utils.w8a8_triton_block_scaled_mm.__globals__["get_w8a8_block_fp8_configs"] is \
        fp8_utils.get_w8a8_block_fp8_configs
    user = tmp_path / "user"
    write_cfg(user, 5120, 6144, "NVIDIA_H200", {"64": {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128,
                                                       "GROUP_SIZE_M": 1, "num_warps": 4, "num_stages": 4}})
    monkeypatch.setenv(fc.ENV_USER_DIR, str(user))
    gpus.names = [RTX, "NVIDIA H200"]  # device 0 is the small card, as on the reference pair
    gpus.current = 1
    h200 = fp8_utils.get_w8a8_block_fp8_configs(5120, 6144, 128, 128)
    assert list(h200) == [64] and h200[64]["num_stages"] == 4
    gpus.current = 0
    rtx = fp8_utils.get_w8a8_block_fp8_configs(5120, 6144, 128, 128)
    shipped = json.loads((SHIPPED / fc.config_file_name(5120, 6144, RTX_FILE)).read_text())
    assert rtx == {int(k): v for k, v in shipped.items()}
    assert fc.resolved()[("NVIDIA_H200", 5120, 6144, 128, 128)][0] == fc.USER
    assert fc.resolved()[(RTX_FILE, 5120, 6144, 128, 128)][0] == fc.PACKAGE


def test_patched_lookup_is_vllms_before_cuda_init(patched_lookup, gpus, tmp_path, monkeypatch):
    """Without CUDA the original runs: vLLM's folder only, named by vLLM's platform."""
    from vllm.utils.platform_utils import get_device_name_as_file_name

    fp8_utils = patched_lookup
    gpus.initialized = False
    user = tmp_path / "user"
    monkeypatch.setenv(fc.ENV_USER_DIR, str(user))
    write_cfg(user, 5120, 6144, get_device_name_as_file_name())  # the name vLLM would ask for
    fp8_utils.get_w8a8_block_fp8_configs.cache_clear()
    assert fp8_utils.get_w8a8_block_fp8_configs(5120, 6144, 128, 128) is None
    assert fc.resolved() == {}
    gpus.initialized = True  # same process once CUDA is up: now our folders are searched
    gpus.names = [get_device_name_as_file_name()]
    assert fp8_utils.get_w8a8_block_fp8_configs(5120, 6144, 128, 128) is not None


def test_patched_lookup_copes_with_vllm_shipped_h200_file(patched_lookup, gpus, monkeypatch):
    """vLLM's own folder is still searched last (it ships H200 files for other shapes)."""
    fp8_utils = patched_lookup
    monkeypatch.delenv(fc.ENV_USER_DIR, raising=False)
    folder = Path(fp8_utils.__file__).parent / "configs"
    shipped = folder / fc.config_file_name(12288, 7168, "NVIDIA_H200")
    if not shipped.exists():
        pytest.skip("this vLLM ships no H200 file for 12288x7168")
    got = fp8_utils.get_w8a8_block_fp8_configs(12288, 7168, 128, 128)
    assert got == {int(k): v for k, v in json.loads(shipped.read_text()).items()}
    assert fc.resolved()[("NVIDIA_H200", 12288, 7168, 128, 128)] == (fc.VLLM, shipped)


def test_copied_folder_wins_over_vllms(patched_lookup, gpus, tmp_path, monkeypatch):
    fp8_utils = patched_lookup
    folder = Path(fp8_utils.__file__).parent / "configs"
    shipped = folder / fc.config_file_name(12288, 7168, "NVIDIA_H200")
    if not shipped.exists():
        pytest.skip("this vLLM ships no H200 file for 12288x7168")
    user = tmp_path / "user"
    user.mkdir()
    body = json.loads(shipped.read_text())
    body = {"4096": body[next(iter(body))]}
    (user / shipped.name).write_text(json.dumps(body))
    monkeypatch.setenv(fc.ENV_USER_DIR, str(user))
    assert list(fp8_utils.get_w8a8_block_fp8_configs(12288, 7168, 128, 128)) == [4096]
