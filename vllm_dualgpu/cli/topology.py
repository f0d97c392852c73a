"""``vllm-dualgpu plan`` for a box or a fleet: every topology side by side and the one to pick.

Selected when ``--gpus`` names hosts (``;`` between hosts, or ``name=`` before a host's first
card) or ``--fleet FILE`` is given; otherwise ``plan`` plans one pipeline as before. Pure: the
planner does the work (``vllm_dualgpu.planner.topology``); no vLLM, torch or NVML import.

Fleet file (JSON; ``--fleet example`` is the bundled two-host example)::

    {"hosts": [{"name": "box1", "gpus": "RTX 5080,RTX 5080"},
               {"name": "box2", "gpus": ["RTX 4070 Ti SUPER", "RTX 4070 Ti SUPER"]}],
     "model": {"reference": "qwen3.8-27b", "weight_format": "nvfp4"},   (or {"path": DIR})
     "serve": {"max_model_len": 65536, "max_num_seqs": 8},              (PlanRequest fields)
     "link": {"network_gbits_per_s": 10},  "tp_sizes": [1, 2],  "prefer": "throughput",
     "route_name": "qwen3.8-27b",  "topology": "host-tp2",  "measured": {"box1": 244, "box2": 177}}

Measured file (``--measured FILE``): a JSON object of replica name -> decode tokens/s.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

from vllm_dualgpu.cli.inputs import read_config, with_default_reserves

_FILE_KEYS = {"hosts", "model", "serve", "link", "tp_sizes", "prefer", "route_name", "topology", "measured", "about"}
EXAMPLE = "fleet-example.json"


class _Fail(Exception):
    """A usage problem: print the message and exit 2."""


def add_to(p) -> None:
    """Add the fleet options to ``plan``'s parser and route fleet requests here."""
    g = p.add_argument_group("box or fleet (hosts separated by ';' in --gpus, or --fleet)")
    g.add_argument("--fleet", metavar="FILE", help="fleet file (JSON), or 'example' for the bundled two-host example")
    g.add_argument("--measured", metavar="FILE", help="measured decode tokens/s per replica (JSON: name -> tokens/s)")
    g.add_argument("--topology", metavar="ID", help="the topology the measured rates belong to (default: the one they match)")
    g.add_argument("--tp-sizes", metavar="N,N", help="TP sizes to try (default: 1, and 2/4/8 up to the largest host)")
    g.add_argument("--prefer", choices=("throughput", "latency", "context"), help="what the recommendation maximises (default: throughput)")
    g.add_argument("--decode-context", type=int, metavar="TOKENS",
                   help="context per sequence for the decode estimate and the batch (default: --max-model-len)")
    g.add_argument("--route-name", help="model name clients use, for the route output (default: the model's name)")
    plain = p.get_default("run")
    p.set_defaults(run=lambda args: run(args) if wants(args) else (refuse_fleet_options(args) or plain(args)))


#: Options that only a fleet plan reads: on one pipeline they are refused, not ignored.
FLEET_ONLY = (("decode_context", "--decode-context"), ("prefer", "--prefer"), ("tp_sizes", "--tp-sizes"),
              ("route_name", "--route-name"))


def refuse_fleet_options(args) -> int | None:
    """2 (after one line on stderr) when a fleet-only option was given to a one-pipeline plan,
    else None. The executor of one pipeline predicts decode at --max-model-len and takes no TP
    sizes or routes, so the plan cannot take them either."""
    given = [flag for attr, flag in FLEET_ONLY if getattr(args, attr, None) is not None]
    if not given:
        return None
    print(f"vllm-dualgpu plan: {given[0]} is a fleet option: it applies to hosts separated by ';' in --gpus or "
          f"a --fleet file, not to one pipeline (whose decode is predicted at --max-model-len, as the "
          f"executor plans it); drop it, or plan a fleet", file=sys.stderr)
    return 2


def wants(args) -> bool:
    from vllm_dualgpu.planner.topology import _HOST_NAME

    if getattr(args, "fleet", None) or getattr(args, "measured", None) or getattr(args, "topology", None):
        return True
    gpus = getattr(args, "gpus", None) or ""
    return ";" in gpus or bool(_HOST_NAME.match(gpus))


def _load_json(path: str, what: str):
    try:
        return json.loads(Path(path).expanduser().read_text())
    except OSError as e:
        raise _Fail(f"cannot read the {what} {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise _Fail(f"the {what} {path} is not valid JSON: {e}") from None


def _fleet_file(name: str) -> tuple[dict, str]:
    if name == "example":
        text = resources.files("vllm_dualgpu.planner").joinpath("reference", EXAMPLE).read_text()
        return json.loads(text), f"bundled example {EXAMPLE}"
    return _load_json(name, "fleet file"), name


def _with_reserves(specs):
    """Hosts with the executor's default reserve on cards whose entry names none (as ``plan``)."""
    from vllm_dualgpu.planner import parse_gpus
    from vllm_dualgpu.planner.topology import Fleet, Host

    return Fleet(tuple(Host(name, tuple(with_default_reserves(parse_gpus(spec), spec))) for name, spec in specs))


def _sizes(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise _Fail(f"--tp-sizes {text!r}: write e.g. 1,2") from None


def semicolon_note(gpus: str | None) -> str | None:
    """When ``;`` splits --gpus into hosts none of which is named: say that this plans several
    machines (a ``;`` typed for ``,`` would otherwise turn one box into a fleet silently)."""
    from vllm_dualgpu.planner.topology import _HOST_NAME, split_hosts

    if not gpus or ";" not in gpus or any(_HOST_NAME.match(p) for p in gpus.split(";") if p.strip()):
        return None
    hosts = split_hosts(gpus)
    if len(hosts) < 2:
        return None
    shown = "; ".join(f"{name}: {cards.strip()}" for name, cards in hosts)
    one_box = ",".join(cards.strip() for _, cards in hosts)
    return (f"';' in --gpus separates machines: this plans {len(hosts)} hosts ({shown}). For the cards "
            f"of one machine, separate them with ',': --gpus '{one_box}'")


def _build(args):
    """(config, weight format, quantization, fleet, request, link, tp sizes, prefer, route name,
    topology id, measured, source) from the flags and the fleet file; flags win."""
    from vllm_dualgpu import planner as P
    from vllm_dualgpu.planner import topology as T
    from vllm_dualgpu.planner.topology_routes import read_measured
    from vllm_dualgpu.planner.topology_speed import LinkModel

    doc, source = ({}, "--gpus")
    if args.fleet:
        doc, source = _fleet_file(args.fleet)
        if not isinstance(doc, dict):
            raise _Fail("the fleet file must be a JSON object")
        bad = sorted(set(doc) - _FILE_KEYS)
        if bad:
            raise _Fail(f"unknown fleet file key(s) {bad}; use {', '.join(sorted(_FILE_KEYS))}")
    if args.gpus and args.fleet:
        raise _Fail("give --gpus or --fleet, not both")
    if args.gpus:
        if args.gpus.strip().lower() == "local":
            raise _Fail("--gpus local reads one machine; name the hosts' cards, e.g. 'box1=RTX 5080,RTX 5080;box2=...'")
        specs = T.split_hosts(args.gpus)
    elif doc:
        specs = T.file_hosts(doc)
    else:
        raise _Fail("name the hosts' cards with --gpus 'box1=CARD,CARD;box2=CARD,...' or give --fleet FILE")
    fleet = _with_reserves(specs)

    m = doc.get("model") or {}
    if not isinstance(m, dict):
        raise _Fail('the fleet file\'s "model" must be an object: {"reference": NAME} or {"path": DIR}')
    model_arg = args.model or args.model_opt
    if model_arg and args.reference:
        raise _Fail("give a model or --reference, not both")
    ref_defaults = {}
    if model_arg or (m.get("path") and not args.reference):
        cfg, where = read_config(model_arg or str(m["path"]))
    else:
        ref = args.reference or m.get("reference") or "qwen3.8-27b"
        m = {**m, "reference": ref, "path": None}
        cfg = P.reference_config(ref)
        where = f"reference {ref}"
        ref_defaults = dict((cfg.get("_vllm_dualgpu") or {}).get("serve") or {})
    weight_format = args.weight_format if args.weight_format != "auto" else str(m.get("weight_format") or "auto")
    quantization = args.quantization or m.get("quantization")

    serve = dict(ref_defaults)
    serve.update(doc.get("serve") or {})
    for flag, val in (("--layer-partition", args.layer_partition), ("--gpu-order", args.gpu_order),
                      ("--speculative-config", args.speculative_config)):
        if val:
            raise _Fail(f"{flag} is not planned per topology yet; plan one pipeline without ';' in --gpus to use it")
    flags = {
        "num_gpu_blocks_override": args.num_gpu_blocks_override, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_model_len": args.max_model_len, "kv_cache_dtype": args.kv_cache_dtype, "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_context_tokens": args.decode_context,
        "language_model_only": True if args.language_model_only else None,
        "enforce_eager": True if args.enforce_eager else None,
        "enable_prefix_caching": False if args.enable_prefix_caching is False else None,
    }
    serve.update({k: v for k, v in flags.items() if v is not None})
    serve.setdefault("max_model_len", -1)
    serve.setdefault("max_num_seqs", 0)  # vLLM's default for the card
    request = T.request_from_dict(serve)
    link = LinkModel.from_dict(doc.get("link") or {})
    if args.tensor_parallel_size != 1:
        tp_sizes = [args.tensor_parallel_size]
    elif args.tp_sizes:
        tp_sizes = _sizes(args.tp_sizes)
    else:
        tp_sizes = doc.get("tp_sizes")
    prefer = args.prefer or doc.get("prefer") or "throughput"
    named = Path(model_arg or str(m.get("path") or "")).name
    route_name = args.route_name or doc.get("route_name") or named or args.reference or m.get("reference") or "qwen3.8-27b"
    measured = None
    if args.measured:
        measured = read_measured(_load_json(args.measured, "measured file"))
    elif doc.get("measured") is not None:
        measured = read_measured(doc["measured"])
    topology = args.topology or doc.get("topology")
    return (cfg, weight_format, quantization, fleet, request, link, tp_sizes, prefer, route_name, topology,
            measured, f"{source}, {where}")


def run(args) -> int:
    from vllm_dualgpu import planner as P
    from vllm_dualgpu.planner.topology import plan_fleet
    from vllm_dualgpu.planner.topology_report import fleet_table
    from vllm_dualgpu.planner.topology_routes import fleet_routes

    try:
        (cfg, wf, q, fleet, request, link, tp_sizes, prefer, route_name, topology, measured, source) = _build(args)
        fp = plan_fleet(cfg, fleet, request, weight_format=wf, quantization=q, tp_sizes=tp_sizes, link=link, prefer=prefer)
        routes = fleet_routes(fp, route_name, measured, topology)
    except _Fail as e:
        print(f"vllm-dualgpu plan: {e}", file=sys.stderr)
        return 2
    except P.PlanError as e:
        print(f"vllm-dualgpu plan: {e}", file=sys.stderr)
        return 2 if isinstance(e, P.BadRequest) else 1
    except (TypeError, ValueError) as e:  # a fleet file value of the wrong type
        print(f"vllm-dualgpu plan: bad fleet settings: {e}", file=sys.stderr)
        return 2
    rc = 0 if fp.recommended is not None else 1
    note = semicolon_note(args.gpus)
    if args.json:
        out = {"source": source, **fp.to_dict(), "routes": routes, "notes": [note] if note else []}
        if rc:
            out["error"] = "nothing fits"
            out["message"] = fp.what_fits()
        print(json.dumps(out, indent=2))
        return rc
    print(f"vllm-dualgpu plan ({source})")
    if note:
        print(f"Note: {note}")
    text = fleet_table(fp, routes)
    if rc:
        print(text, end="", file=sys.stderr)
        print(f"vllm-dualgpu plan: nothing fits; {fp.what_fits()}", file=sys.stderr)
        return rc
    print(text, end="")
    return 0
