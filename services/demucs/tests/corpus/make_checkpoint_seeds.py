#!/usr/bin/env python3
"""Makes the checkpoint fuzz seeds: the test fixture `tests/fixtures/repo/a0a0a0a0.th`
(a tiny HTDemucs in the `torch.save` zip layout) cut down to a few tensors, so each
seed is a few kilobytes. Needs only the standard library (no torch):
    python3 make_checkpoint_seeds.py
"""
import io
import os
import pickle
import sys
import types
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "fixtures", "repo", "a0a0a0a0.th")


class Ref:
    """A class or function reference kept by name, pickled back as the same GLOBAL."""

    registry = {}

    def __init__(self, module, name):
        self.module, self.name = module, name

    def __call__(self, *args):
        return Call(self, args)


class Call:
    def __init__(self, ref, args):
        self.ref, self.args, self.state, self.items = ref, args, None, []

    def __setstate__(self, state):
        self.state = state

    def __setitem__(self, k, v):
        self.items.append((k, v))


class Storage:
    def __init__(self, pid):
        self.pid = pid


class Reader(pickle.Unpickler):
    def find_class(self, module, name):
        return Ref(module, name)

    def persistent_load(self, pid):
        return Storage(pid)


def stub(ref):
    """A real object that pickles as GLOBAL module.name."""
    parts = ref.module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                sys.modules[name] = types.ModuleType(name)
    mod = sys.modules[ref.module]
    if not hasattr(mod, ref.name):
        f = type(ref.name, (), {})
        f.__module__, f.__qualname__ = ref.module, ref.name
        setattr(mod, ref.name, f)
    return getattr(mod, ref.name)


class Reduced:
    def __init__(self, call):
        self.call = call

    def __reduce__(self):
        c = self.call
        state = conv(c.state) if c.state is not None else None
        items = iter([(conv(k), conv(v)) for k, v in c.items]) if c.items else None
        return (stub(c.ref), tuple(conv(a) for a in c.args), state, None, items)


def conv(v):
    if isinstance(v, Ref):
        return stub(v)
    if isinstance(v, Call):
        return Reduced(v)
    if isinstance(v, Storage):
        return v
    if isinstance(v, dict):
        return {conv(k): conv(x) for k, x in v.items()}
    if isinstance(v, list):
        return [conv(x) for x in v]
    if isinstance(v, tuple):
        return tuple(conv(x) for x in v)
    return v


class Writer(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return tuple(conv(x) for x in obj.pid)
        return None


def make(name, keep):
    src = zipfile.ZipFile(SRC)
    pkl = next(n for n in src.namelist() if n.endswith("data.pkl"))
    root = Reader(io.BytesIO(src.read(pkl))).load()
    state = root["state"]
    items = state.items if isinstance(state, Call) else list(state.items())
    items = items[:keep]
    if isinstance(state, Call):
        state.items = items
    else:
        root["state"] = dict(items)
    keys = set()
    for _, t in items:
        keys.add(t.args[0].pid[2])
    out = io.BytesIO()
    Writer(out, protocol=2).dump(conv(root))
    with zipfile.ZipFile(os.path.join(HERE, "checkpoint", name), "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", out.getvalue())
        z.writestr("archive/byteorder", src.read("archive/byteorder"))
        for k in sorted(keys):
            z.writestr(f"archive/data/{k}", src.read(f"archive/data/{k}"))
    print(name, os.path.getsize(os.path.join(HERE, "checkpoint", name)), "bytes")


make("tiny_3_tensors.th", 3)
make("tiny_no_tensors.th", 0)
# The pickle alone (the fuzz target wraps `.pkl` inputs into a fresh zip, so mutations
# reach the unpickler and the tensor rebuild without breaking the zip's CRC).
with zipfile.ZipFile(os.path.join(HERE, "checkpoint", "tiny_3_tensors.th")) as z:
    with open(os.path.join(HERE, "checkpoint", "tiny_3_tensors.pkl"), "wb") as f:
        f.write(z.read("archive/data.pkl"))
