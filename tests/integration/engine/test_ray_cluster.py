"""The dualgpu-ray executor's planning on a local Ray cluster with the seed-002 fleet's cards.

Four Ray nodes on this machine (``ray.cluster_utils.Cluster``): box1 and box2 of the recorded
fleet (tests/fixtures/ray_fleet_seed002.json) with two GPU resources each, box3 whose NVML fails
(no driver) and a head node whose NVML hangs. Only NVML is faked (tests/fixtures/fake_nvml on
each node's PYTHONPATH); the facts travel through the package's own Ray task, vLLM's config is
real and the placement group is Ray's. The cluster starts once for the module.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
from plan_exports import restore_environ  # noqa: F401  (autouse: the plan's exports undone)

ray = pytest.importorskip("ray", reason="the dualgpu-ray tests need ray (pip install ray)")

from vllm_dualgpu import envs  # noqa: E402
from vllm_dualgpu.engine import handoff, ray_facts, ray_planning  # noqa: E402
from vllm_dualgpu.planner.cluster import ClusterRefused  # noqa: E402

FIXTURES = Path(__file__).parents[2] / "fixtures"
FLEET = json.loads((FIXTURES / "ray_fleet_seed002.json").read_text())["nodes"]
MIB = 1 << 20
# A Qwen3-8B-class dense model in bf16 (about 15 GiB of weights): needs all four 16 GB cards.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def node_env(**extra) -> dict:
    return {"PYTHONPATH": str(FIXTURES / "fake_nvml"), **extra}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    import vllm.triton_utils  # noqa: F401  (vLLM's Triton flag, read under tests/conftest.py's setting)

    with pytest.MonkeyPatch.context() as mp:
        # A raylet refuses GPU resources that CUDA_VISIBLE_DEVICES does not list, and the CPU
        # tests of vLLM 0.34 set it empty (tests/conftest.py): the fake nodes start without it.
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "env_vars": node_env(FAKE_NVML_DELAY="30")})
        nodes = {}
        for name, facts, fail in (("box1", FLEET[0], None), ("box2", FLEET[1], None), ("box3", None, "Driver Not Loaded")):
            gpus = facts["gpus"] if facts else [{}, {}]
            if name == "box1":  # its first card drives the desktop; NVML cannot say for the others
                gpus = [{**gpus[0], "display": True}, *gpus[1:]]
            env = node_env(FAKE_NVML_GPUS=json.dumps(gpus))
            if fail:
                env["FAKE_NVML_FAIL"] = fail
            nodes[name] = c.add_node(num_cpus=1, num_gpus=2, resources={name: 2}, env_vars=env)
        ray.init(address=c.address, include_dashboard=False)
        yield SimpleNamespace(ids={k: n.node_id for k, n in nodes.items()}, head=c.head_node.node_id)
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def facts(cluster):
    return {f.node_id: f for f in ray_facts.gather(ray_facts.gpu_nodes())}


@pytest.fixture
def config(tmp_path):
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()
    import vllm_dualgpu

    vllm_dualgpu.register()
    from vllm.engine.arg_utils import EngineArgs

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    cfg = EngineArgs(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True,
                     pipeline_parallel_size=4, distributed_executor_backend="dualgpu-ray",
                     max_model_len=16384).create_engine_config()
    cfg.parallel_config.worker_cls = ray_planning.planning.STOCK_WORKER
    return cfg


def test_each_node_reports_its_own_cards_through_the_ray_task(cluster, facts):
    assert set(facts) == {cluster.ids["box1"], cluster.ids["box2"], cluster.ids["box3"]}
    for name, recorded in (("box1", FLEET[0]), ("box2", FLEET[1])):
        f = facts[cluster.ids[name]]
        assert f.error is None
        assert [(g.index, g.name, g.total_bytes, g.free_bytes) for g in f.gpus] == [
            (g["index"], g["name"], g["total_bytes"], g["free_bytes"]) for g in recorded["gpus"]]
        assert [g.display for g in f.gpus] == ([True, None] if name == "box1" else [None, None])
        assert f.versions["vllm"] == metadata.version("vllm")
        assert f.versions["torch"] == metadata.version("torch")
        assert f.ip == ray.nodes()[0]["NodeManagerAddress"]
        assert "lo" in f.interfaces
    broken = facts[cluster.ids["box3"]]
    assert broken.gpus == () and "Driver Not Loaded" in broken.error


def test_a_node_that_does_not_answer_in_time(cluster):
    head = [n for n in ray.nodes() if n["NodeID"] == cluster.head]
    (f,) = ray_facts.gather(head, timeout_s=2)
    assert f.error == "no answer within 2 s" and f.node_id == cluster.head


def test_unreachable_facts_refuse_before_any_placement_group(cluster, config):
    with pytest.raises(ClusterRefused) as e:
        ray_planning.apply_cluster_plan(config)
    first = str(e.value).splitlines()[0]
    assert cluster.ids["box3"][:8] in first and "Driver Not Loaded" in first
    assert config.parallel_config.placement_group is None
    assert ray_planning.BUNDLE_ENV not in os.environ
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # set for the workers, as on one host


def test_bundle_indices_of_the_user_are_refused(cluster, config, monkeypatch):
    monkeypatch.setenv(ray_planning.BUNDLE_ENV, "0,1,2,3")
    with pytest.raises(ClusterRefused, match="VLLM_RAY_BUNDLE_INDICES=0,1,2,3 is set"):
        ray_planning.apply_cluster_plan(config)


@pytest.fixture(scope="module")
def fleet_group(cluster):
    """box2's bundles first in the group: the rank order must not follow bundle order."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"GPU": 1, "box2": 1}] * 2 + [{"GPU": 1, "box1": 1}] * 2, strategy="PACK")
    ray.get(pg.ready(), timeout=60)
    yield pg
    remove_placement_group(pg)


def test_plan_on_the_recorded_fleet(cluster, facts, config, fleet_group):
    from vllm_dualgpu.engine import planning
    from vllm_dualgpu.planner.topology import Fleet, Host, plan_fleet

    box1, box2 = cluster.ids["box1"], cluster.ids["box2"]
    host = {box1: "box1", box2: "box2"}
    bundles = ray_planning.bundle_nodes(fleet_group)
    assert bundles == [(0, box2), (1, box2), (2, box1), (3, box1)]
    applied = ray_planning.apply_to_bundles(config, [facts[box1], facts[box2]], bundles)
    record = handoff.load(config)
    ranks = [(host[r.node_id], r.physical_gpu_id) for r in record.ranks]

    # `vllm-dualgpu plan --fleet` on the same cards (the executor's reserve) and the same
    # request picks the same rank order and split for its one pipeline across the hosts.
    fleet = Fleet(tuple(Host(host[n], tuple(replace(g, reserve_bytes=envs.DEFAULT_RESERVE_BYTES)
                                            for g in facts[n].gpus)) for n in (box1, box2)))
    offline = plan_fleet(QWEN3_8B, fleet, planning.plan_request(config, None), tp_sizes=(1,))
    rp = offline.get("fleet-tp1").replicas[0]
    assert rp.fits
    assert ranks == [(s[0].host, s[0].gpu.index) for s in rp.stage_of_rank]
    assert record.partition == tuple(rp.plan.partition)
    assert ranks[0][0] != ranks[-1][0] and len({h for h, _ in ranks[:2]}) == 1  # hosts kept together

    # each rank takes a bundle on its own node (box2's are 0 and 1, box1's 2 and 3)
    indices = [int(i) for i in os.environ[ray_planning.BUNDLE_ENV].split(",")]
    assert [dict(bundles)[i] for i in indices] == [r.node_id for r in record.ranks]
    assert [r.gpu_name for r in record.ranks] == [facts[r.node_id].gpus[r.physical_gpu_id].name for r in record.ranks]
    assert all(r.reserve_bytes == envs.DEFAULT_RESERVE_BYTES and r.cap_bytes is None for r in record.ranks)
    # the planner budgets each rank by the one rule: free memory of its card minus the reserve
    free_mib = {(g["index"], n["hostname"]): g["free_bytes"] // MIB for n in FLEET for g in n["gpus"]}
    assert [r.gpu.budget_bytes for r in applied.plan.ranks] == [
        free_mib[(i, h)] * MIB - envs.DEFAULT_RESERVE_BYTES for h, i in ranks]
    assert sum(record.partition) == QWEN3_8B["num_hidden_layers"] and len(record.partition) == 4
    assert os.environ["VLLM_PP_LAYER_PARTITION"] == ",".join(map(str, record.partition))
    assert config.parallel_config.worker_cls == ray_planning.planning.OUR_WORKER
    assert ray_planning.node_gpu_order(record, 0) == [i for h, i in ranks if h == ranks[0][0]]
    assert ray_planning.node_gpu_order(record, 3) == [i for h, i in ranks if h == ranks[3][0]]


def test_headless_cards_keep_256_mib_across_nodes_as_on_one_host(cluster, facts, config, fleet_group, monkeypatch):
    """box2's cards report no display: they keep 256 MiB; box1's desktop card and the card NVML
    cannot say about keep 1 GiB; VLLM_DUALGPU_RESERVE's one size still wins."""
    box1, box2 = facts[cluster.ids["box1"]], facts[cluster.ids["box2"]]
    headless = replace(box2, gpus=tuple(replace(g, display=False) for g in box2.gpus))
    bundles = ray_planning.bundle_nodes(fleet_group)
    ray_planning.apply_to_bundles(config, [box1, headless], bundles)
    got = {(r.node_id == box2.node_id, r.physical_gpu_id): (r.reserve_bytes, r.reserve_reason)
           for r in handoff.load(config).ranks}
    assert got == {(False, 0): (1 << 30, "display active"), (False, 1): (1 << 30, "display state unknown"),
                   (True, 0): (256 * MIB, "no display on this card"), (True, 1): (256 * MIB, "no display on this card")}
    from vllm_dualgpu.engine import preflight

    monkeypatch.setenv(envs.RESERVE, "512MiB")
    preflight.capture_settings(config)  # as the front end reads it
    ray_planning.apply_to_bundles(config, [box1, headless], bundles)
    assert {r.reserve_bytes for r in handoff.load(config).ranks} == {512 * MIB}


def test_plan_file_records_the_nodes_for_replay(cluster, facts, config, fleet_group, tmp_path, monkeypatch):
    from vllm_dualgpu.planner.cluster import NodeFacts

    path = tmp_path / "plan.json"
    monkeypatch.setenv(envs.PLAN_FILE, str(path))
    gathered = [facts[cluster.ids["box1"]], facts[cluster.ids["box2"]]]
    ray_planning.apply_to_bundles(config, gathered, ray_planning.bundle_nodes(fleet_group))
    data = json.loads(path.read_text())
    assert [NodeFacts.from_dict(d) for d in data["ray_nodes"]] == gathered
    assert ",".join(map(str, data["ray_bundle_indices"])) == os.environ[ray_planning.BUNDLE_ENV]
    assert data["partition"] == list(handoff.load(config).partition)


def test_each_worker_takes_its_nodes_gpus_in_planned_order(cluster, facts, config, fleet_group):
    ray_planning.apply_to_bundles(config, [facts[cluster.ids["box1"]], facts[cluster.ids["box2"]]],
                                  ray_planning.bundle_nodes(fleet_group))
    pc = copy.deepcopy(config.parallel_config)
    record = handoff.load(config)
    # a rank on box2, whose card 1 (15750 MiB free) goes before its card 0 (16020 MiB)
    rank = next(r.rank for r in record.ranks if r.node_id == cluster.ids["box2"])
    pc.assigned_physical_gpu_ids = [0, 1]  # what RayExecutorV2 hands every worker of a node: sorted
    worker = SimpleNamespace(vllm_config=config, rank=rank, parallel_config=pc)
    ray_planning.prepare_worker(worker)
    assert pc.assigned_physical_gpu_ids == [1, 0]
    assert pc.distributed_executor_backend == "ray"
    pc.assigned_physical_gpu_ids = [0, 2]
    with pytest.raises(RuntimeError, match="Ray gave this node GPUs"):
        ray_planning.prepare_worker(worker)


def test_the_bare_name_selects_the_ray_executor(config):
    from vllm_dualgpu.engine.ray_executor import DualGpuRayExecutor

    assert config.parallel_config.distributed_executor_backend is DualGpuRayExecutor
    assert config.parallel_config.use_ray


def test_executor_logs_the_refusal_first_and_spawns_nothing(cluster, config, monkeypatch):
    import logging

    from vllm.platforms import current_platform

    from vllm_dualgpu.engine import ray_executor as rx
    from vllm_dualgpu.log import logger

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self=None: True)
    # (RayExecutorV2._init_executor is left as vLLM ships it: the run's start checks its source)
    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger.addHandler(handler)
    e = object.__new__(rx.DualGpuRayExecutor)
    e.vllm_config, e.parallel_config = config, config.parallel_config
    try:
        with pytest.raises(ClusterRefused):
            e._init_executor()
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1 and records[0].levelname == "ERROR"
    assert "Driver Not Loaded" in records[0].getMessage().splitlines()[0]
    assert config.parallel_config.placement_group is None  # refused before anything was placed
