"""Every random number generator a training process draws from, saved and restored, so that a resumed run
draws what the uninterrupted one would have (dropout, the loader's workers, anything seeded globally)."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng_state() -> dict:
    """Every RNG this process uses, as tensors and plain types (loadable with weights_only=True)."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                      "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
            "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                       "gauss_next": py_gauss}}


def restore_rng_state(rng: dict) -> None:
    """Put back what capture_rng_state saved."""
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    n = rng["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    random.setstate((rng["python"]["version"], tuple(rng["python"]["state"].tolist()), rng["python"]["gauss_next"]))
