"""Route weights for replica topologies, in the forms two routers accept.

Weights are proportional to each replica's decode throughput: predicted by the planner, or
measured (a JSON object of replica name -> tokens/s, e.g. ``{"box1": 244, "box2": 177}``).
They are integer percentages summing to 100, apportioned by largest remainder (Hamilton), the
method GPUStack's gateway applies to target weights; every replica gets at least 1, since a
route whose targets mix weight 0 and weight > 0 is not served.

Checked against (the stored sources, December 2026):

* GPUStack v2.2.3 (the version of the reference setup; also the 2.3 documentation): a model
  route's targets carry ``weight: int >= 0`` (``gpustack/schemas/model_routes.py``,
  ``ModelRouteTargetUpdate``); the API is ``POST /v2/model-routes`` (and ``PUT
  /v2/model-routes/{id}``) with ``{"name", "targets": [{"model_id", "weight"}]}``; the gateway
  turns weights into percentages with ``hamilton_calculate_weight`` (``gpustack/gateway/utils.py``)
  and splits a target's share evenly over that model's instances, so each replica must be its
  own model deployment (one instance each) for the weights to apply per replica. The 2.3 docs:
  either every target has a weight > 0 or none has.
* vLLM production-stack router (``vllm-router``), release vllm-stack-0.1.12 and its main branch
  at a6c01db (August 2026): ``--service-discovery static --static-backends URL,URL
  --static-models M,M --routing-logic roundrobin|session|kvaware|prefixaware|...``; there is no
  weight option, and listing a URL twice does not weight it (``RoundRobinRouter`` keys on the set
  of URLs). So the weights cannot be expressed there; the command below is plain round robin.
"""

from __future__ import annotations

import math

from vllm_dualgpu.planner.errors import BadRequest

GPUSTACK_VERSION = "2.2.3"
PRODUCTION_STACK_VERSION = "vllm-stack-0.1.12"


def read_measured(d) -> dict[str, float]:
    """Check a measured-throughput object: replica name -> tokens/s (positive numbers)."""
    if not isinstance(d, dict) or not d:
        raise BadRequest('the measured file must be a JSON object of replica name -> tokens/s, e.g. {"box1": 244, "box2": 177}')
    out = {}
    for k, v in d.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise BadRequest(f"measured throughput of {k!r} is {v!r}; give tokens/s as a positive number")
        out[str(k)] = float(v)
    return out


def route_weights(rates: dict[str, float]) -> dict[str, int]:
    """Integer percentages proportional to ``rates`` (largest remainder, each >= 1, sum 100)."""
    if not rates:
        return {}
    if any(v <= 0 for v in rates.values()):
        raise BadRequest("route weights need a positive throughput for every replica")
    if len(rates) > 100:
        raise BadRequest("more than 100 replicas cannot each get an integer percentage")
    total = sum(rates.values())
    exact = {k: v * 100 / total for k, v in rates.items()}
    out = {k: int(e) for k, e in exact.items()}
    order = sorted(rates, key=lambda k: (-(exact[k] - out[k]), list(rates).index(k)))
    for k in order[: 100 - sum(out.values())]:
        out[k] += 1
    for k in [k for k in out if out[k] == 0]:  # a zero weight would take the route down
        donor = max(out, key=lambda x: out[x])
        out[donor] -= 1
        out[k] = 1
    return out


def gpustack_route(route_name: str, weights: dict[str, int]) -> dict:
    """The body of ``POST /v2/model-routes`` (GPUStack 2.2.3); replace each ``model_id`` with
    the id of the model deployment serving that replica (``GET /v2/models``)."""
    return {
        "name": route_name,
        "categories": ["llm"],
        "targets": [{"model_id": f"<id of the {route_name} deployment on {name}>", "weight": w}
                    for name, w in weights.items()],
    }


def production_stack_command(route_name: str, backends: dict[str, str]) -> str:
    """``vllm-router`` with static backends (production-stack: no weight option)."""
    urls = ",".join(backends.values())
    models = ",".join([route_name] * len(backends))
    return (f"vllm-router --service-discovery static --static-backends {urls} "
            f"--static-models {models} --routing-logic roundrobin")


def backend_urls(replicas: list[tuple[str, str]], port: int = 8000) -> dict[str, str]:
    """A placeholder URL per replica, ``(name, host)`` in order: ``http://HOST:PORT``, the port
    counting up for replicas that share a host."""
    seen: dict[str, int] = {}
    out = {}
    for name, host in replicas:
        n = seen.get(host, 0)
        seen[host] = n + 1
        out[name] = f"http://{host}:{port + n}"
    return out


def routes_for(route_name: str, replicas: list[tuple[str, str, float]], source: str) -> dict:
    """Everything a router user pastes: ``replicas`` as (name, host, tokens/s)."""
    weights = route_weights({n: r for n, _, r in replicas})
    backends = backend_urls([(n, h) for n, h, _ in replicas])
    return {
        "source": source,
        "tokens_per_s": {n: round(r, 1) for n, _, r in replicas},
        "weights": weights,
        "gpustack": {
            "version": GPUSTACK_VERSION,
            "api": "POST /v2/model-routes",
            "body": gpustack_route(route_name, weights),
            "ui": "Routes > Edit > target weights " + " / ".join(f"{n} {w}" for n, w in weights.items()),
        },
        "production_stack": {
            "version": PRODUCTION_STACK_VERSION,
            "command": production_stack_command(route_name, backends),
            "note": "the production-stack router has no weight option (listing a URL twice does not "
                    "weight it): it routes by round robin, session, KV or prefix; put a weighted "
                    "proxy in front, or use GPUStack's route weights",
        },
    }


def fleet_routes(fp, route_name: str, measured: dict[str, float] | None = None, topology_id: str | None = None) -> dict:
    """Route weights for every topology of ``fp`` (a ``FleetPlan``) with two or more replicas that
    fit: predicted, or for one topology measured. The measured rates go to ``topology_id``, else
    to the topology whose replica names they match (the recommended one first)."""
    multi = [t for t in fp.topologies if len(t.fitting) > 1]
    out = {}
    for t in multi:
        if all(r.tokens_per_s for r in t.fitting):
            out[t.id] = routes_for(route_name, [(r.name, r.layout.hosts[0], r.tokens_per_s) for r in t.fitting], "predicted")
    if measured is None:
        if topology_id is not None:
            fp.get(topology_id)  # an unknown id is an error even without a measured file
        return out
    names = set(measured)
    if topology_id is not None:
        target = fp.get(topology_id)
    else:
        order = sorted(multi, key=lambda t: t is not fp.recommended)
        target = next((t for t in order if {r.name for r in t.fitting} == names), None)
        if target is None:
            known = "; ".join(f"{t.id}: {', '.join(r.name for r in t.fitting)}" for t in multi) or "none"
            raise BadRequest(f"the measured replicas {sorted(names)} match no topology with several replicas "
                             f"that fit (replicas by topology: {known})")
    have = {r.name: r for r in target.fitting}
    if len(have) < 2:
        raise BadRequest(f"{target.id} has {len(have)} replica(s) that fit; route weights need two or more")
    if set(have) != names:
        raise BadRequest(f"the measured file names {sorted(names)}; {target.id}'s replicas are {sorted(have)}")
    out[target.id] = routes_for(route_name, [(n, have[n].layout.hosts[0], measured[n]) for n in have], "measured")
    return out
