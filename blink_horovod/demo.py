"""``make demo``: stock Horovod and Blink side by side, on two "servers" of two ranks each.

Runs ``blinkrun -np 4 -H localhost:2,127.0.0.1:2 --gloo`` (two hosts as horovodrun
sees them, so two servers of two ranks: the full three-stage allreduce --
Blink's trees within each server, Horovod's Gloo ring across) and trains the
same small MLP twice in the same job, from the same initial weights and on
the same data: once with stock Horovod (``blink_horovod.ops.bypass()``) and once
with Blink underneath the same ``hvd.DistributedOptimizer``.  Prints the
per-step communication time of both (the time ``optimizer.synchronize()``
waits for the gradient allreduces after backward), whether the two models
match, what ``blink_horovod.stats()`` counted, and -- from the planner and the
simulator -- Blink's plan and its simulated speedup over NCCL for an
allocation of a DGX-1V (the paper's Figure 1 setting).

    python -m blink_horovod.demo [--steps 10] [--hidden 1024] [--no-sim]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

HOSTS = "localhost:2,127.0.0.1:2"
DGX1V_ALLOCATION = "dgx1v:0,1,2,5,6"  # an irregular 5-GPU allocation, where rings fit badly
SIM_BYTES = 100 * 1024 * 1024


# -- the worker (one rank of the job) ------------------------------------------------------------------

def _worker(args: argparse.Namespace) -> int:
    import copy

    import torch
    from torch import nn
    import torch.nn.functional as F

    import horovod.torch as hvd

    import blink_horovod
    from blink_horovod.ops.patching import bypass

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)
    torch.manual_seed(1234)
    dev = torch.device("cpu")
    if _use_cuda(args.device, hvd.local_size()):
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    h = args.hidden
    model_b = nn.Sequential(nn.Linear(256, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 256),
                            nn.ReLU(), nn.Linear(256, 10)).to(dev)
    model_s = copy.deepcopy(model_b)
    nparams = sum(p.numel() for p in model_b.parameters())
    opt_b = hvd.DistributedOptimizer(torch.optim.SGD(model_b.parameters(), lr=0.05, momentum=0.9),
                                     named_parameters=model_b.named_parameters())
    with bypass():
        opt_s = hvd.DistributedOptimizer(torch.optim.SGD(model_s.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model_s.named_parameters())
        hvd.broadcast_parameters(model_s.state_dict(), root_rank=0)
    hvd.broadcast_parameters(model_b.state_dict(), root_rank=0)

    def step(model, opt, x, y) -> tuple[float, float]:
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sync()
        t1 = time.perf_counter()
        opt.synchronize()
        sync()
        t2 = time.perf_counter()
        with opt.skip_synchronize():
            opt.step()
        sync()
        return t2 - t1, time.perf_counter() - t0

    gen = torch.Generator().manual_seed(7 + rank)
    rows = []
    for i in range(args.steps):
        x = torch.randn(args.batch, 256, generator=gen).to(dev)
        y = torch.randint(0, 10, (args.batch,), generator=gen).to(dev)
        with bypass():
            hvd.barrier()
            cs, ts = step(model_s, opt_s, x, y)
            hvd.barrier()
        cb, tb = step(model_b, opt_b, x, y)
        rows.append({"step": i, "stock_comm_s": cs, "blink_comm_s": cb, "stock_step_s": ts, "blink_step_s": tb})

    diff = max(float((pb - ps).abs().max()) for pb, ps in zip(model_b.parameters(), model_s.parameters()))
    digest = float(sum(float(p.double().sum()) for p in model_b.parameters()))
    with bypass():
        digests = hvd.allgather_object(digest)
        comm = hvd.allgather_object([(r["stock_comm_s"], r["blink_comm_s"]) for r in rows])
    stats = blink_horovod.stats()
    if rank == 0:
        from blink_horovod.ops import torch_ops

        ctx = torch_ops.context()
        out = {
            "size": size, "hosts": HOSTS, "params": nparams, "grad_bytes": nparams * 4, "steps": args.steps,
            "servers": ctx.layout.num_servers if ctx else None, "local_size": ctx.layout.local_size if ctx else None,
            "topology": _topology_name(ctx), "device": str(dev),
            "blink_reason": torch_ops.disabled_reason(),
            # a step's communication time is the slowest rank's
            "rows": [dict(r, stock_comm_s=max(c[i][0] for c in comm), blink_comm_s=max(c[i][1] for c in comm))
                     for i, r in enumerate(rows)],
            "max_abs_diff": diff, "ranks_agree": len(set(digests)) == 1, "stats": stats,
        }
        with open(args.json, "w") as fh:
            json.dump(out, fh)
    hvd.shutdown()
    return 0


def _use_cuda(device: str, local_size: int) -> bool:
    """``--device``: cuda when asked, or (auto) when the server has a GPU for each of its ranks."""
    if device == "cpu":
        return False
    import torch

    if device == "cuda":
        return True
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_size


def _topology_name(ctx) -> str | None:
    """The server topology Blink plans on: the GPU communicator's where CUDA tensors ran, else the CPU one's."""
    if ctx is None:
        return None
    gpu = getattr(ctx.engine.devices, "comm", None)
    comm = gpu if gpu is not None else ctx.communicator
    return comm.topology.name if comm is not None else None


# -- the launcher side -------------------------------------------------------------------------------------

def _run_job(args: argparse.Namespace, out_json: str) -> dict:
    from blink_horovod.launcher.blinkrun import build_command

    cmd, env, _, _ = build_command(["-np", "4", "-H", HOSTS, "--gloo", sys.executable, "-m", "blink_horovod.demo",
                                    "--worker", "--json", out_json, "--steps", str(args.steps),
                                    "--hidden", str(args.hidden), "--batch", str(args.batch),
                                    "--device", args.device])
    env = dict(env)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    print(f"[demo] {' '.join(['blinkrun', *cmd[1:]])}", flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0 or not os.path.exists(out_json):
        tail = "\n".join((p.stdout + p.stderr).splitlines()[-40:])
        raise SystemExit(f"[demo] the job failed (exit {p.returncode}):\n{tail}")
    print(f"[demo] job finished in {time.time() - t0:.0f} s", flush=True)
    with open(out_json) as fh:
        return json.load(fh)


def _print_training(res: dict) -> None:
    mb = res["grad_bytes"] / 1e6
    print()
    print(f"Training: {res['size']} ranks = {res['servers']} servers x {res['local_size']} ranks "
          f"(-H {res['hosts']} --gloo), intra-server topology {res['topology']}; MLP of {res['params']:,} "
          f"parameters ({mb:.1f} MB of float32 gradients) on {res.get('device', 'cpu')}, {res['steps']} steps")
    if res.get("blink_reason"):
        print(f"  NOTE: Blink stayed out of this job: {res['blink_reason']}")
    print(f"{'step':>5}  {'stock Horovod comm (ms)':>24}  {'Blink comm (ms)':>16}  {'speedup':>8}")
    for r in res["rows"]:
        s, b = r["stock_comm_s"] * 1e3, r["blink_comm_s"] * 1e3
        print(f"{r['step']:>5}  {s:>24.1f}  {b:>16.1f}  {s / b if b > 0 else float('nan'):>7.2f}x")
    rows = res["rows"][1:] or res["rows"]  # step 0 includes planning and buffer setup
    ms = statistics.median(r["stock_comm_s"] for r in rows) * 1e3
    mbk = statistics.median(r["blink_comm_s"] for r in rows) * 1e3
    print(f"{'median':>5}  {ms:>24.1f}  {mbk:>16.1f}  {ms / mbk if mbk > 0 else float('nan'):>7.2f}x"
          f"   (steps 1..{res['steps'] - 1}; effective {mb / mbk:.2f} GB/s vs {mb / ms:.2f} GB/s)")
    ok = res["max_abs_diff"] <= 1e-5
    print(f"models match: max |w_blink - w_stock| = {res['max_abs_diff']:.2e} -> {'yes' if ok else 'NO'} "
          f"(tolerance 1e-5); all ranks hold the same Blink model: {'yes' if res['ranks_agree'] else 'NO'}")
    st = res["stats"]
    print(f"blink_horovod.stats() on rank 0: {st['allreduce']} allreduces and {st['broadcast']} broadcasts "
          f"carried by Blink, {st['bytes'] / 1e6:.1f} MB in {st['seconds']:.3f} s; {st['fallback']} calls to stock "
          f"Horovod")


def _print_dgx1v() -> None:
    print()
    print(f"Plan and simulated speedup on a DGX-1V allocation ({DGX1V_ALLOCATION}, allreduce of "
          f"{SIM_BYTES >> 20} MB):")
    try:
        from .planner import make_plan
        from .topology.machines import resolve
    except ImportError as exc:
        print(f"  (skipped: the planner is not available: {exc})")
        return
    topo = resolve(DGX1V_ALLOCATION)
    plan = make_plan(topo, "allreduce")
    print(f"  planner: {len(plan.trees)} trees, rate {plan.rate_gbps:.1f} GB/s, proven optimum "
          f"{plan.optimum_gbps:.1f} GB/s")
    for t in plan.trees:
        edges = " ".join(f"{a}-{b}" for a, b in t.edges)
        print(f"    root {t.root}  fraction {t.fraction:.3f}  {t.channel:<6}  {edges}")
    try:
        from .sim.blink import simulate_blink
        from .sim.nccl import nccl_time
    except ImportError as exc:
        print(f"  (simulated speedup skipped: the simulator is not available: {exc})")
        return
    try:
        est = simulate_blink(topo, "allreduce", SIM_BYTES, plan=plan)
        nccl = nccl_time(topo, "allreduce", SIM_BYTES)
    except Exception as exc:  # the simulator is another layer: report, don't fail the demo
        print(f"  (simulated speedup skipped: {type(exc).__name__}: {exc})")
        return
    print(f"  simulator: Blink {est.time_s * 1e3:.2f} ms (chunk {est.chunk_bytes >> 10} KB), NCCL rings "
          f"{nccl * 1e3:.2f} ms -> simulated speedup {nccl / est.time_s:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timeout", type=int, default=900, help="seconds for the horovodrun job")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the models train (auto: cuda when every local rank has a GPU of its own)")
    ap.add_argument("--no-sim", action="store_true", help="skip the DGX-1V plan and simulation")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    with tempfile.TemporaryDirectory(prefix="blink-demo-") as tmp:
        res = _run_job(args, os.path.join(tmp, "demo.json"))
    _print_training(res)
    if not args.no_sim:
        _print_dgx1v()
    return 0


if __name__ == "__main__":
    sys.exit(main())
