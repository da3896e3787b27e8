"""One-off: the worker's warm-up on W1's 8B model (timings for docs), then W1-like batches compile nothing."""
import tempfile, time
from pathlib import Path
import torch, torch._dynamo.utils as du
from bench import packed_path
from bench.w1 import W1_SHAPES, build_model
from models.warmup import describe, warm_up
from schemas import ScoreRequest

t = time.perf_counter()
model = build_model(W1_SHAPES)
with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
    d = Path(tmp) / "w1"
    packed_path.save_model_dir(model, d)
    del model; torch.cuda.empty_cache()
    print("built and saved", round(time.perf_counter() - t, 1), "s", flush=True)
    t = time.perf_counter()
    scorer = packed_path.make_scorer(d, 16384, share_prefix_min_tokens=32)
    print("loaded", round(time.perf_counter() - t, 1), "s", flush=True)
    report = warm_up(scorer)
    print(describe(report), flush=True)
    print("peak GiB", round(torch.cuda.max_memory_allocated() / 2**30, 1), flush=True)
    before = int(du.counters["stats"]["unique_graphs"])
    g = torch.Generator().manual_seed(0)
    shapes = [[(0, (700, 30, 1200))], [(0, (5, 9))], [(60, (1, 1))], [(40, (300, 20)), (0, (1,))], [(500, (3, 3))]]
    for salt, batch in enumerate(shapes):
        reqs = [ScoreRequest(request_id=f"b{salt}-{r}", query=tuple(torch.randint(100, 30000, (q,), generator=g).tolist()) or None,
                             items=tuple(tuple(torch.randint(100, 30000, (n,), generator=g).tolist()) for n in items),
                             return_pooled_hidden_states=True) for r, (q, items) in enumerate(batch)]
        for _ in range(2):
            t = time.perf_counter(); res = scorer.score(reqs); ms = (time.perf_counter() - t) * 1e3
            assert all(x.ok for x in res), [x.error for x in res if not x.ok]
        print(batch, "ms", round(ms, 1), "new graphs", int(du.counters["stats"]["unique_graphs"]) - before, flush=True)
