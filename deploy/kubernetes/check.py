#!/usr/bin/env python3
"""Checks of rendered deploy/kubernetes manifests that the Kubernetes schemas cannot make.

Usage: check.py REPO_ROOT RENDERED.yaml... (each file: one overlay, rendered by render.py)

- KEDA ScaledObjects against the documented shape of the `nats-jetstream` trigger
  (kubernetes-validate has no schema for custom resources and passes them silently), and
  against nats/: the stream and durable consumer they watch must exist there (the pool
  consumers `workers-<model>-<lane>` of nats/consumers/pool.json, for every model and
  lane of the Rust enums in services/core/src/request/options.rs).
- A worker ScaledObject scales on exactly the pool consumers its workers serve, both
  lanes of each: `STEMQ_ENGINE` dsp serves dsp; demucs the models the overlay's
  `models pull` Job downloads; auto both. Never the unrouted `workers` consumer (no
  worker pulls it), never a pool nobody in the deployment serves (its jobs would wake
  pods that never take them).
- Every Deployment/StatefulSet container: readiness and liveness probes, CPU and memory
  requests, a memory limit, no `:latest` image; every Deployment and StatefulSet has a
  PodDisruptionBudget selecting it.
- Worker pods: terminationGracePeriodSeconds larger than STEMQ_GRACE_S; GPU pods ask for
  `nvidia.com/gpu` in limits and tolerate the GPU taint.
- Every Secret and ConfigMap a pod uses is defined (per-installation ones in
  secrets-example/, whose values must all be REPLACE_ME).
- Every STEMQ_* variable is one the CLI reads (an `env = "..."` in services/*/src).
Prints one line per problem; exit status 1 when there is any.
"""

import glob
import json
import os
import re
import sys

import yaml

problems = []
notes = set()
# Variables the manifests set ahead of the CLI: a note, not a problem, while no
# `env = "..."` reads them (remove an entry once its branch is in main).
PENDING_ENV = {}


def bad(where, message):
    problems.append(f"{where}: {message}")


def is_int_string(v):
    return isinstance(v, str) and re.fullmatch(r"[0-9]+", v) is not None


# KEDA nats-jetstream trigger metadata (keda.sh docs, scalers/nats-jetstream).
NATS_JS_REQUIRED = {"natsServerMonitoringEndpoint", "stream", "consumer"}
NATS_JS_KNOWN = NATS_JS_REQUIRED | {"account", "accountID", "lagThreshold",
                                    "activationLagThreshold", "useHttps"}
SCALED_OBJECT_SPEC = {"scaleTargetRef": dict, "minReplicaCount": int, "maxReplicaCount": int,
                      "pollingInterval": int, "cooldownPeriod": int, "idleReplicaCount": int,
                      "initialCooldownPeriod": int, "triggers": list, "advanced": dict,
                      "fallback": dict}


def served_models(engine, pulled):
    """The models a worker with STEMQ_ENGINE `engine` serves, given the models pulled
    into its model folder (services/stemq/src/services.rs, `EngineKind`)."""
    return {"dsp": {"dsp"}, "demucs": set(pulled), "auto": {"dsp"} | set(pulled)}.get(engine)


def pulled_models(docs):
    """Models the overlay's Jobs download (`stemq models pull NAME...`)."""
    pulled = set()
    for d in docs:
        if d["kind"] != "Job":
            continue
        for c in d["spec"]["template"]["spec"].get("containers", []):
            args = c.get("args", [])
            if args[:2] == ["models", "pull"]:
                pulled |= set(args[2:])
    return pulled


def check_worker_triggers(d, docs, lanes):
    """The triggers of a worker ScaledObject are the pools its deployment serves."""
    where = f"ScaledObject/{d['metadata']['name']}"
    target = d.get("spec", {}).get("scaleTargetRef", {}).get("name")
    deployments = [x for x in docs if x["kind"] == "Deployment" and x["metadata"]["name"] == target]
    workers = [c for x in deployments for c in pod_spec(x).get("containers", [])
               if c.get("args", [None])[0] == "worker"]
    if not workers:
        return
    engine = env_value(workers[0], "STEMQ_ENGINE") or "auto"
    served = served_models(engine, pulled_models(docs))
    if served is None:
        bad(where, f"STEMQ_ENGINE {engine!r} of {target}: no known models to scale on")
        return
    want = {f"workers-{m}-{lane}" for m in served for lane in lanes}
    have = {t.get("metadata", {}).get("consumer") for t in d["spec"].get("triggers") or []}
    if "workers" in have:
        bad(where, "scales on the unrouted `workers` consumer, which no worker pulls "
            "(the ingress's router moves its requests into the pools): use the pool consumers")
    for c in sorted(want - have):
        bad(where, f"no trigger on {c}, a pool {target} serves ({engine}): its jobs would not wake it")
    for c in sorted(have - want - {"workers"}):
        bad(where, f"trigger on {c}, a pool {target} does not serve ({engine}, models {sorted(served)}): "
            "its jobs would wake pods that never take them")


def check_scaled_object(d, names, nats_defs):
    where = f"ScaledObject/{d['metadata']['name']}"
    if d.get("apiVersion") != "keda.sh/v1alpha1":
        bad(where, f"apiVersion {d.get('apiVersion')} (want keda.sh/v1alpha1)")
    spec = d.get("spec", {})
    for key, value in spec.items():
        want = SCALED_OBJECT_SPEC.get(key)
        if want is None:
            bad(where, f"unknown spec field {key}")
        elif not isinstance(value, want) or isinstance(value, bool):
            bad(where, f"spec.{key} must be {want.__name__}, is {value!r}")
    target = spec.get("scaleTargetRef", {}).get("name")
    if ("Deployment", target) not in names:
        bad(where, f"scaleTargetRef {target!r} is not a Deployment of this overlay")
    lo, hi = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    if not 0 <= lo <= hi or hi < 1:
        bad(where, f"replica range {lo}..{hi}")
    triggers = spec.get("triggers") or []
    if not triggers:
        bad(where, "no triggers")
    for t in triggers:
        if t.get("type") != "nats-jetstream":
            bad(where, f"trigger type {t.get('type')!r} (want nats-jetstream)")
            continue
        md = t.get("metadata", {})
        for k, v in md.items():
            if k not in NATS_JS_KNOWN:
                bad(where, f"unknown nats-jetstream metadata {k}")
            if not isinstance(v, str):
                bad(where, f"metadata.{k} must be a string (KEDA metadata is map[string]string)")
        for k in NATS_JS_REQUIRED - set(md):
            bad(where, f"missing metadata {k}")
        if not ({"account", "accountID"} & set(md)):
            bad(where, "one of account / accountID is required")
        for k in ("lagThreshold", "activationLagThreshold"):
            if k in md and not is_int_string(md[k]):
                bad(where, f"{k} must be an integer string, is {md[k]!r}")
        if md.get("lagThreshold") == "0":
            bad(where, "lagThreshold 0")
        endpoint = md.get("natsServerMonitoringEndpoint", "")
        if not re.fullmatch(r"[a-z0-9.-]+:8222", endpoint):
            bad(where, f"natsServerMonitoringEndpoint {endpoint!r}: want host:8222")
        ns = d["metadata"].get("namespace")
        if not endpoint.startswith(f"nats-headless.{ns}.svc"):
            bad(where, f"endpoint {endpoint!r} is not the headless NATS Service of namespace {ns}"
                " (KEDA resolves it from its own namespace; clustered NATS needs per-node names)")
        streams, consumers, _ = nats_defs
        if md.get("stream") not in streams:
            bad(where, f"stream {md.get('stream')!r} is not defined in nats/streams")
        if (md.get("stream"), md.get("consumer")) not in consumers:
            bad(where, f"consumer {md.get('consumer')!r} of {md.get('stream')!r} is not in nats/consumers")


def pod_spec(d):
    if d["kind"] in ("Deployment", "StatefulSet", "Job"):
        return d["spec"]["template"]["spec"]
    return None


def env_value(container, name):
    for e in container.get("env", []):
        if e["name"] == name:
            return e.get("value")
    return None


def check_workloads(docs, known_env, secret_names, example_configmaps):
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    configmaps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    configmaps |= example_configmaps
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    for d in docs:
        spec = pod_spec(d)
        if spec is None:
            continue
        where = f"{d['kind']}/{d['metadata']['name']}"
        labels = d["spec"]["template"]["metadata"].get("labels", {})
        if d["kind"] != "Job":
            if not any(all(labels.get(k) == v for k, v in
                           p["spec"]["selector"]["matchLabels"].items()) for p in pdbs):
                bad(where, "no PodDisruptionBudget selects it")
        for c in spec.get("containers", []):
            cw = f"{where} container {c['name']}"
            image = c.get("image", "")
            if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1] and "@" not in image:
                bad(cw, f"image {image!r} has no pinned tag or digest")
            if d["kind"] != "Job":
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe not in c:
                        bad(cw, f"no {probe}")
            res = c.get("resources", {})
            for r in ("cpu", "memory"):
                if r not in res.get("requests", {}):
                    bad(cw, f"no {r} request")
            if "memory" not in res.get("limits", {}):
                bad(cw, "no memory limit")
            for e in c.get("env", []):
                if e["name"].startswith("STEMQ_") and e["name"] not in known_env:
                    if e["name"] in PENDING_ENV:
                        notes.add(f"note: {e['name']} is not read by this stemq yet "
                                  f"({PENDING_ENV[e['name']]}); it is ignored until then")
                    else:
                        bad(cw, f"{e['name']} is not read by the stemq CLI")
            for src in c.get("envFrom", []):
                if "secretRef" in src and src["secretRef"]["name"] not in secret_names:
                    bad(cw, f"Secret {src['secretRef']['name']} is not in secrets-example/")
                if "configMapRef" in src and src["configMapRef"]["name"] not in configmaps:
                    bad(cw, f"ConfigMap {src['configMapRef']['name']} is not defined")
            if c.get("args", [None])[0] == "worker":
                grace = int(env_value(c, "STEMQ_GRACE_S") or 600)
                if spec.get("terminationGracePeriodSeconds", 30) <= grace:
                    bad(where, f"terminationGracePeriodSeconds must exceed STEMQ_GRACE_S ({grace})")
                gpus = res.get("limits", {}).get("nvidia.com/gpu")
                if env_value(c, "STEMQ_ENGINE") == "demucs" and "gpu" in d["metadata"]["name"]:
                    if not gpus:
                        bad(cw, "GPU pool without an nvidia.com/gpu limit")
                    if not any(t.get("key") == "nvidia.com/gpu" for t in spec.get("tolerations", [])):
                        bad(where, "GPU pool does not tolerate the nvidia.com/gpu taint")
        for v in spec.get("volumes", []):
            if "secret" in v and v["secret"]["secretName"] not in secret_names:
                bad(where, f"Secret {v['secret']['secretName']} is not in secrets-example/")
            if "configMap" in v and v["configMap"]["name"] not in configmaps:
                bad(where, f"ConfigMap {v['configMap']['name']} is not defined")
    return names


def wire_names(root, enum):
    """The wire names of a `wire_names!(Enum { Variant => "name", ... })` in the core crate."""
    text = open(f"{root}/services/core/src/request/options.rs").read()
    body = re.search(r"wire_names!\(\s*" + enum + r"\s*\{(.*?)\}\s*\)", text, re.S)
    if not body:
        bad("services/core/src/request/options.rs", f"no wire_names!({enum} ...)")
        return []
    return re.findall(r'=>\s*"([a-z0-9_]+)"', body.group(1))


def nats_definitions(root):
    streams = {json.load(open(p))["name"] for p in glob.glob(f"{root}/nats/streams/*.json")}
    models, lanes = wire_names(root, "Model"), wire_names(root, "Priority")
    consumers = set()
    for p in glob.glob(f"{root}/nats/consumers/*.json"):
        c = json.load(open(p))
        name = c["config"]["durable_name"]
        if "{model}" in name:
            # nats/consumers/pool.json: one consumer per model and lane.
            consumers |= {(c["stream"], name.replace("{model}", m).replace("{lane}", lane))
                          for m in models for lane in lanes}
        else:
            consumers.add((c["stream"], name))
    return streams, consumers, lanes


def cli_env(root):
    names = set()
    for p in glob.glob(f"{root}/services/*/src/**/*.rs", recursive=True):
        names |= set(re.findall(r'env\s*=\s*"([A-Z0-9_]+)"', open(p).read()))
    return names


def main():
    root, files = sys.argv[1], sys.argv[2:]
    known_env = cli_env(root)
    secrets_file = f"{root}/deploy/kubernetes/secrets-example/secrets.yaml"
    secret_docs = list(yaml.safe_load_all(open(secrets_file)))
    secret_names = {d["metadata"]["name"] for d in secret_docs if d["kind"] == "Secret"}
    example_configmaps = {d["metadata"]["name"] for d in secret_docs if d["kind"] == "ConfigMap"}
    for d in secret_docs:
        for k, v in {**d.get("stringData", {}), **(d.get("data", {}) if d["kind"] == "ConfigMap" else {})}.items():
            if v != "REPLACE_ME":
                bad(secrets_file, f"{d['metadata']['name']}.{k} holds a value, not REPLACE_ME")
        if "data" in d and d["kind"] == "Secret":
            bad(secrets_file, f"{d['metadata']['name']}: use stringData placeholders, not data")
    nats_defs = nats_definitions(root)
    for f in files:
        docs = [d for d in yaml.safe_load_all(open(f)) if d]
        before = len(problems)
        names = check_workloads(docs, known_env, secret_names, example_configmaps)
        for d in docs:
            if d["kind"] == "ScaledObject":
                check_scaled_object(d, names, nats_defs)
                check_worker_triggers(d, docs, nats_defs[2])
        for p in problems[before:]:
            print(f"{os.path.basename(f)}: {p}")
        kinds = sorted({d["kind"] for d in docs})
        print(f"{os.path.basename(f)}: {len(docs)} objects ({', '.join(kinds)}), "
              f"{len(problems) - before} problems")
    for n in sorted(notes):
        print(n)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
