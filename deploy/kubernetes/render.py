#!/usr/bin/env python3
"""Renders a kustomization of deploy/kubernetes/ where kustomize is not installed.

It implements only the subset of Kustomize these manifests use, and refuses anything else
(so a new feature in a kustomization fails here instead of rendering wrongly):
- `resources`: YAML files and directories holding a kustomization.yaml (recursively);
- `namespace`: set on every namespaced object (the Namespace objects are left alone);
- `images`: `name` -> `newName` / `newTag` / `digest` on containers and initContainers;
- `replicas`: `name` + `count` on Deployments and StatefulSets;
- `patches` with `path` only: strategic merge patches matched by kind + name. Built-in
  kinds merge lists of containers/env/volumes/ports by their merge keys (as Kubernetes'
  patch strategy does); custom resources (KEDA) get JSON merge patch semantics (lists are
  replaced whole); a `null` value deletes a key.

Usage: render.py DIR [OUT]   (prints the documents, or writes them to OUT)
       render.py --same-as KUSTOMIZE_OUTPUT DIR   (exit 1 unless kustomize's rendering of DIR
                                                   has the same objects, list order aside)
scripts/check-deploy.sh runs the second form where `kubectl kustomize` is installed.
"""

import copy
import os
import sys

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "images", "replicas", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass"}
# Patch merge keys of the lists these manifests patch (Kubernetes' patchMergeKey).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
              "imagePullSecrets": "name"}
BUILTIN_GROUPS = {"v1", "apps/v1", "batch/v1", "policy/v1", "autoscaling/v2",
                  "networking.k8s.io/v1", "rbac.authorization.k8s.io/v1"}


def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def merge(base, patch, strategic):
    """Merges patch into base (both dicts) and returns the result."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value, strategic)
        elif (strategic and key in MERGE_KEYS and isinstance(value, list)
              and isinstance(out.get(key), list)):
            mk = MERGE_KEYS[key]
            items = list(out[key])
            for item in value:
                at = [i for i, x in enumerate(items) if x.get(mk) == item.get(mk)]
                if at:
                    items[at[0]] = merge(items[at[0]], item, strategic)
                else:
                    items.append(copy.deepcopy(item))
            out[key] = items
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_images(node, images):
    if isinstance(node, dict):
        for key in ("containers", "initContainers"):
            for c in node.get(key, []) if isinstance(node.get(key), list) else []:
                image = c.get("image", "")
                name = image.split("@")[0]
                if ":" in name.rsplit("/", 1)[-1]:
                    name = name.rsplit(":", 1)[0]
                for rule in images:
                    if rule["name"] == name:
                        new = rule.get("newName", name)
                        if "digest" in rule:
                            new += "@" + rule["digest"]
                        elif "newTag" in rule:
                            new += ":" + str(rule["newTag"])
                        elif image != name:
                            new += image[len(name):]
                        c["image"] = new
        for v in node.values():
            set_images(v, images)
    elif isinstance(node, list):
        for v in node:
            set_images(v, images)


def build(directory):
    kpath = os.path.join(directory, "kustomization.yaml")
    (k,) = load_docs(kpath)
    unknown = set(k) - SUPPORTED
    if unknown:
        sys.exit(f"{kpath}: not supported by render.py: {sorted(unknown)}")
    docs = []
    for res in k.get("resources", []):
        path = os.path.normpath(os.path.join(directory, res))
        docs += build(path) if os.path.isdir(path) else load_docs(path)
    seen = set()
    for d in docs:
        ident = (d["kind"], d["metadata"]["name"])
        if ident in seen:
            sys.exit(f"{directory}: {ident} defined twice")
        seen.add(ident)
    for p in k.get("patches", []):
        if set(p) != {"path"}:
            sys.exit(f"{kpath}: only `patches: - path: FILE` is supported")
        for patch in load_docs(os.path.join(directory, p["path"])):
            ident = (patch["kind"], patch["metadata"]["name"])
            hits = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == ident]
            if not hits:
                sys.exit(f"{directory}: patch target {ident} not found")
            strategic = patch["apiVersion"] in BUILTIN_GROUPS
            docs[hits[0]] = merge(docs[hits[0]], patch, strategic)
    for r in k.get("replicas", []):
        hits = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")
                and d["metadata"]["name"] == r["name"]]
        if not hits:
            sys.exit(f"{kpath}: replicas target {r['name']} not found")
        hits[0]["spec"]["replicas"] = r["count"]
    if "images" in k:
        set_images(docs, k["images"])
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return docs


def same_as(kustomize_output, directory):
    def by_id(docs):
        return {(d["kind"], d["metadata"]["name"]): d for d in docs if d}

    def norm(x):
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        if isinstance(x, list):
            return sorted((norm(v) for v in x), key=lambda v: yaml.safe_dump(v, sort_keys=True))
        return x

    theirs, ours = by_id(load_docs(kustomize_output)), by_id(build(directory))
    differ = sorted(set(theirs) ^ set(ours))
    differ += sorted(k for k in set(theirs) & set(ours) if norm(theirs[k]) != norm(ours[k]))
    for k in differ:
        print(f"{directory}: {k[0]}/{k[1]} differs from kustomize's", file=sys.stderr)
    return 1 if differ else 0


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--same-as":
        sys.exit(same_as(sys.argv[2], sys.argv[3]))
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    text = yaml.safe_dump_all(build(sys.argv[1]), sort_keys=False)
    if len(sys.argv) == 3:
        with open(sys.argv[2], "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
