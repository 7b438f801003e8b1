"""One TP-2 vLLM engine (``LLM``, multiprocess workers) that meets failures on one rank and
keeps serving (``test_failures.py`` runs it, with the environment of ``tools.engine_env`` and
this folder on the workers' ``PYTHONPATH``); prints its JSON result on the stdout line that
starts with ``tools.RESULT``.

    failures_engine.py START STORE V   the engine loads START (version V of STORE), then:
      a layout that fails on rank 1 (attached twice), the raw replies of the next calls, a good
      attach, that layout again over the binding, a sync to V+1, a corrupted frame of V+2
      (one rank fetches it), the frame restored and the sync to V+2 again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools
from engine import engine_kwargs, generate
from failures_layout import BAD


def raised(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """What ``fn`` raised: its type and message (an error if it raised nothing)."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    raise AssertionError(f"{fn.__name__} raised nothing")


def scenario(a: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    from deltastore.engines import vllm as dv

    llm = LLM(**engine_kwargs(a.start, 2))
    v, store = a.at, a.store
    out: dict[str, Any] = {"start": generate(llm)}
    # a layout that fails on rank 1 only: the driver's error, then what the engine serves
    out["bad_attach"] = raised(dv.attach, llm, store, version=v, layout=BAD)
    out["after_bad_attach"] = generate(llm)
    # the next calls' raw replies: each the answer to that call, not to the failed one
    out["info_unbound"] = llm.collective_rpc("deltastore_info", kwargs={"call": "info-1"})
    out["retry_raw"] = llm.collective_rpc(
        "deltastore_attach", args=(store, v, None, {"layout": BAD}), kwargs={"call": "retry"}
    )
    out["attach"] = dv.attach(llm, store, version=v, reader_id="failures")
    out["bad_over_binding"] = raised(dv.attach, llm, store, version=v, layout=BAD, reader_id="x")
    out["info_bound"] = llm.collective_rpc("deltastore_info", kwargs={"call": "info-2"})
    out["sync_next"] = dv.sync(llm, v + 1, check=True)
    out["after_sync_next"] = generate(llm)
    # a corrupted frame of the version after: one rank fetches it
    target = v + 2
    objects = sorted(Path(store, "versions", f"{target:020d}").glob("*.dsz"))
    saved = {o: o.read_bytes() for o in objects}
    tools.corrupt_frame(Path(store), target)
    out["corrupt_results"] = dv.sync(llm, target)
    out["corrupt_raised"] = raised(dv.sync, llm, target, check=True)
    out["after_corrupt"] = generate(llm)
    out["status_after_corrupt"] = llm.collective_rpc("deltastore_status", kwargs={"call": "st"})
    for o, data in saved.items():
        o.write_bytes(data)
    out["sync_repaired"] = dv.sync(llm, target, check=True)
    out["after_repaired"] = generate(llm)
    llm.llm_engine.engine_core.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("start")
    p.add_argument("store")
    p.add_argument("at", type=int)
    res = scenario(p.parse_args())
    sys.stdout.write("\n" + tools.RESULT + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
