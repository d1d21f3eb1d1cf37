"""A ``load_weights`` that sends one loader's tensors to five places, read through a reused ring.

The shape of almost every real ``load_weights``: q's into a dict, k slices into the same dict from
another line, transposed v's into a list of pairs, o's into a helper object's list, g's into a
module global. Run it under the sanitizer with a ring that holds one tensor at a time::

    ownsan run -o safetensors_ring=16384 -o safetensors_strict=1 -- python examples/several_holders.py

and the report names five consumers, each with exactly its own three leases, each at the line
that stored them (15 retentions, counted once each). It writes its checkpoint (15 float32 tensors
of 64 x 64, 16 KiB each) into a temporary directory, or into ``--dir``. Without running it,
``ownsan audit examples/several_holders.py`` finds the same five stores (the ``STORE-`` lines), since
``safe_open(...).get_tensor`` is a loader call it knows.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

G = []  # a module global that keeps what it is given
LOADED = None  # what load_weights returned, kept until the program ends (as an engine keeps its model)


class Helper:
    def __init__(self) -> None:
        self.outs = []


def load_weights(path):
    params = {}
    pairs = []
    helper = Helper()
    with safe_open(path, "pt") as f:
        for name in f.keys():
            w = f.get_tensor(name)
            if "q_proj" in name:
                params[name] = w  # STORE-Q
            elif "k_proj" in name:
                params[name] = w[:8]  # STORE-K
            elif "v_proj" in name:
                pairs.append((name, w.t()))  # STORE-V
            elif "o_proj" in name:
                helper.outs.append(w)  # STORE-O
            else:
                G.append(w)  # STORE-G
    return params, pairs, helper


def write_checkpoint(directory: str) -> str:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.{p}_proj.weight": torch.randn(64, 64, generator=gen)
               for i in range(3) for p in ("q", "k", "v", "o", "g")}
    path = os.path.join(directory, "several.safetensors")
    save_file(tensors, path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    args = ap.parse_args()
    global LOADED
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(args.dir or tmp)
        LOADED = params, pairs, helper = load_weights(path)
        print(f"loaded {len(params)} into params, {len(pairs)} pairs, {len(helper.outs)} outs, {len(G)} globals")


if __name__ == "__main__":
    main()
