"""The Markdown table and the verdict lines of tests/benchmarks/bench_serving.py (its rows: bench_serving.formats,
each with `results` per thread count)."""

from __future__ import annotations

from bench_browser import browser_verdicts

KIB = 1024
TARGET_SPEEDUP = 5.0
TARGET_VS_LLAMA_BENCH = 0.9
GGUF_TYPES = ("F16", "Q8_0", "Q4_K_M")


def fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def table(rows: list[dict], threads: int, runtime_names: dict[str, str]) -> str:
    lines = [f"| format | runtime | file MiB | load s | TTFT ms | gen tok/s, 1 thread | gen tok/s, {threads} threads "
             f"| CPU ms/token, 1 thread | peak RSS MiB | KL vs fp32 | top-1 vs fp32 | load avg (1 / {threads} thr) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_label = {r["label"]: r for r in rows if not r.get("same_as")}
    for r in rows:
        one, many = r["results"].get(1, {}), r["results"].get(threads, {})
        runtime = runtime_names[r["runner"]]
        loads = f"{fmt(one.get('load1'), '.1f')} / {fmt(many.get('load1'), '.1f')}"
        err = one.get("error") or many.get("error")
        if err:
            lines.append(f"| {r['label']} | {runtime} | {r['bytes'] / KIB**2:.1f} | error: {err} | | | | | | | | {loads} |")
            continue
        q = by_label[r["same_as"]]["results"].get(threads, {}) if r.get("same_as") else many
        rss = many.get("peak_rss_bytes")
        short = f" (stopped after {many['n_gen']})" if many.get("n_gen", 0) < r.get("gen_tokens", 0) else ""
        lines.append(f"| {r['label']} | {runtime} | {r['bytes'] / KIB**2:.1f} | {fmt(many.get('load_s'), '.2f')} | "
                     f"{fmt(many.get('ttft_s') and many['ttft_s'] * 1000, '.0f')} | {fmt(one.get('gen_tps'), '.1f')} | "
                     f"{fmt(many.get('gen_tps'), '.1f')}{short} | "
                     f"{fmt(one.get('gen_cpu_s_per_token') and one['gen_cpu_s_per_token'] * 1000, '.2f')} | "
                     f"{fmt(rss and rss / KIB**2, '.0f')} | "
                     f"{fmt(q.get('kl'), '.2e') if r['runner'] != 'torch' else '0'} | "
                     f"{fmt(q.get('top1') and q['top1'] * 100, '.1f') + '%' if q.get('top1') is not None else '—'} | "
                     f"{loads} |")
    return "\n".join(lines)


def overhead_ms(ours_s: float, raw_s: float) -> str:
    """Our extra time per token over llama-bench's, in ms: unlike the ratio, comparable across model sizes
    (a fixed Python cost per token is a large share of a tiny model's step and a small one of a big one's)."""
    return f"overhead {(ours_s - raw_s) * 1000:+.3f} ms"


def verdicts(rows: list[dict], threads: int) -> list[str]:
    out = []

    def speed(label: str, runner: str, n: int, key: str = "gen_tps") -> float | None:
        return next((r["results"].get(n, {}).get(key) for r in rows
                     if r["label"] == label and r["runner"] == runner), None)

    q4, fp32 = speed("GGUF Q4_K_M", "llama.cpp", threads), speed("PyTorch fp32", "torch", threads)
    if q4 and fp32:
        x = q4 / fp32
        out.append(f"llama.cpp Q4_K_M generates {x:.1f}x as fast as PyTorch fp32 "
                   f"({'meets' if x >= TARGET_SPEEDUP else 'misses'} the >= {TARGET_SPEEDUP:.0f}x target).")
    for t in GGUF_TYPES:
        for n in sorted({1, threads}):
            ours, raw = speed(f"GGUF {t}", "llama.cpp", n), speed(f"GGUF {t}", "llama-bench", n)
            if ours and raw:
                x = ours / raw
                out.append(f"GGUF {t}, {n} thread(s): our Python path {ours:.1f} tok/s = {x:.2f}x llama-bench {raw:.1f} "
                           f"({overhead_ms(1 / ours, 1 / raw)} per token; "
                           f"{'meets' if x >= TARGET_VS_LLAMA_BENCH else 'misses'} >= {TARGET_VS_LLAMA_BENCH}x).")
        ours, raw = (speed(f"GGUF {t}", r, 1, "gen_cpu_s_per_token") for r in ("llama.cpp", "llama-bench"))
        if ours and raw:  # CPU time per token: what other jobs on the machine do not change
            x = raw / ours
            out.append(f"GGUF {t}, 1 thread, CPU time per new token: ours {ours * 1000:.2f} ms, llama-bench "
                       f"{raw * 1000:.2f} ms = {x:.2f}x llama-bench's speed ({overhead_ms(ours, raw)} per token; "
                       f"{'meets' if x >= TARGET_VS_LLAMA_BENCH else 'misses'} >= {TARGET_VS_LLAMA_BENCH}x).")
    return out + browser_verdicts(rows, threads)
