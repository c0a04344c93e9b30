import time, torch, torch.distributed as dist
from shmloader._roles import producer as P
from tests.support.harness import run_ranks
from benchmarks.step import step_rank
def fn(rank, world):
    rec = []
    orig = P.Producer._take
    def take(self, run):
        empty = not run.queue
        t0 = time.perf_counter()
        item = orig(self, run)
        rec.append((empty, (time.perf_counter() - t0) * 1e3))
        return item
    P.Producer._take = take
    out = step_rank(rank, world, mode="shmloader", mib=32, warmup=5, steps=40, workers=2, compute_ms=250, compute_kind="sleep", page=64 << 10)
    nexts = [r["next_ms"] for r in out["records"]]
    return {"next": nexts, "take": rec[-40:]}
if __name__ == "__main__":
    out = run_ranks(fn, 2, timeout=200)
    for o in out:
        slow = [(round(n, 2), e, round(t, 2)) for n, (e, t) in zip(o["next"], o["take"]) if n > 0.8]
        print(len(slow), slow)
