"""A bench run's outputs: bench.json (checksummed, atomic), bench.md (the table) and bench.png
(speedup and tau per prompt set and method)."""

from __future__ import annotations

from pathlib import Path

from specjax.atomic import write_bytes_atomic, write_json_atomic


def in_config_order(result: dict) -> dict:
    """Rows and prompt sets in the config's order of sets (a checksummed JSON stores its mappings
    with sorted keys, so a result read back lists its sets alphabetically)."""
    order = {name: i for i, (name, _) in enumerate(result["config"]["sets"])}
    rank = lambda name: order.get(name, len(order))  # noqa: E731
    return dict(result, rows=sorted(result["rows"], key=lambda r: rank(r["set"])),
                sets=dict(sorted(result["sets"].items(), key=lambda kv: rank(kv[0]))))


def markdown(result: dict) -> str:
    result = in_config_order(result)
    meta = result.get("meta", {})
    cfg = result["config"]
    lines = [f"# specjax bench: {cfg['deployment']}", "",
             f"{meta.get('date', '')} on {meta.get('device', '?')}, commit {meta.get('commit', '?')}; "
             f"model {cfg['model']} ({cfg['dtype']}), greedy, exactly {cfg['max_new_tokens']} new tokens a prompt, "
             f"median of {cfg['repeats']} runs (min-max). Speedup = tokens/s over our AR on the same prompts, "
             f"given only where token forcing found no difference from AR.", "",
             "| set | batch | method | tokens/s | spread | tau | lossless | speedup | equal to AR |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lossless = {True: "yes", False: "**no**", None: "-"}[r["lossless"]]
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['set']} | {r['batch']} | {r['method']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f} | {tau} | {lossless} | {speedup} | "
                     f"{r['equal_to_ar']}/{r['prompts']} |")
    lines += ["", "Prompt sets:", ""]
    for name, s in result["sets"].items():
        lines.append(f"- {name} ({s['category']}): {s['source']}; license: {s['license']}")
    if result.get("searched"):
        lines += ["", "Searched configs (memory methods):", ""]
    for name, rec in result.get("searched", {}).items():
        mechanisms = ", ".join(f"{k}={v}" for k, v in sorted(rec["config"].items()))
        lines.append(f"- {name}: memory record {rec['record_id']} ({mechanisms}), measured "
                     f"{rec['measured']['speedup']:.2f}x on {rec['device']} when it was searched")
    if cfg.get("batch1_prompts"):
        lines += ["", f"Batch 1 runs the first {cfg['batch1_prompts']} prompts of each set; larger batches all of them."]
    if result.get("skipped"):
        lines += ["", "Not run (the run's deadline came first): " + ", ".join(result["skipped"])]
    if result.get("unfinished"):
        lines += ["", f"Cut off inside {result['unfinished']}: its rows so far are listed (--resume runs it again)"]
    failed = [r for r in result["rows"] if r["lossless"] is False]
    if failed:
        lines += ["", "Runs that failed the forcing gate (no speedup reported):", ""]
        lines += [f"- {r['set']} B={r['batch']} {r['method']}: {r['note']}" for r in failed]
    ties = [r for r in result["rows"] if r["lossless"] and "near-tie" in r.get("note", "")]
    if ties:
        lines += ["", "Runs that passed the gate with near-tie differences (not bit for bit; their "
                  "free-running tokens may part from AR's after one):", ""]
        lines += [f"- {r['set']} B={r['batch']} {r['method']}: {r['note']}" for r in ties]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not result["rows"]:
        return
    result = in_config_order(result)
    rows = [r for r in result["rows"] if r["batch"] == min(x["batch"] for x in result["rows"])]
    sets = list(dict.fromkeys(r["set"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "ar"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        by_set = {r["set"]: r for r in rows if r["method"] == m}
        x = np.arange(len(sets)) + i * width
        axes[0].bar(x, [by_set[s]["speedup"] or 0 if s in by_set else 0 for s in sets], width, label=m)
        axes[1].bar(x, [(by_set[s]["tau"] or 0) if s in by_set else 0 for s in sets], width, label=m)
    for ax, title in zip(axes, ("speedup over AR (lossless runs only)", "tau (tokens per target step)")):
        ax.set_xticks(np.arange(len(sets)) + 0.4 - width / 2, sets, rotation=20)
        ax.set_title(title)
        ax.axhline(1.0, color="gray", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


def write_report(result: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench.png"}
    write_json_atomic(paths["json"], result)
    write_bytes_atomic(paths["md"], markdown(result).encode())
    plot(result, paths["png"])
    return paths
