"""The search's output directory: results.json (everything measured) and report.md (the story)."""

from __future__ import annotations

import json
from pathlib import Path

from specjax.atomic import write_json_atomic


def replayed(config: dict) -> bool:
    """Acceptance borrowed from a recorded profile: every figure of such a config says so."""
    return config.get("drafter.kind") == "replay"


def _label(config: dict) -> str:
    return f"`{json.dumps(config)}`" + (" (replayed acceptance)" if replayed(config) else "")


def write_report(out: Path, spec, state, device_name: str, cost_device) -> Path:
    ar = state.ar["tokens_per_s"]
    stock, inc = state.stock, state.incumbent
    rows = []
    for key, e in state.evaluated.items():
        m = e["measurement"]
        rows.append({"config": m["config"], "round": e["round"], "tokens_per_s": m["tokens_per_s"],
                     "speedup": m["tokens_per_s"] / ar, "tau": m["tau"], "rejected": m["rejected"],
                     "forcing": m["forcing"], "device": m["device"],
                     "predicted_tokens_per_s": e.get("predicted_tokens_per_s"),
                     "acceptance": "replayed acceptance" if replayed(m["config"]) else "measured"})
    results = {
        "spec": spec.name, "spec_path": spec.path, "deployment": spec.deployment.fingerprint(),
        "measured_on": device_name, "cost_model_device": {"name": cost_device.name, "source": cost_device.source},
        "ar_tokens_per_s": ar, "stock": {"config": stock["config"], "tokens_per_s": stock["tokens_per_s"],
                                         "speedup": stock["tokens_per_s"] / ar, "rejected": stock["rejected"]},
        "found": {"config": inc["config"], "tokens_per_s": inc["tokens_per_s"], "speedup": inc["tokens_per_s"] / ar,
                  "acceptance": "replayed acceptance" if replayed(inc["config"]) else "measured"},
        "measurements": state.measurements, "rounds": state.history, "evaluated": rows,
        "memory_records": state.records}
    from specjax.search.plots import median_relative_error, spearman, write_plots
    fit = [(r["predicted_tokens_per_s"], r["tokens_per_s"]) for r in rows
           if r["predicted_tokens_per_s"] is not None and r["rejected"] is None]
    def finite(x):
        return None if x is None or x != x else x
    results["cost_model_fidelity"] = {
        "configs": len(fit), "median_relative_error": finite(median_relative_error(*zip(*fit)) if fit else None),
        "spearman": finite(spearman(*zip(*fit)) if len(fit) > 1 else None)}
    write_json_atomic(out / "results.json", results)
    plots = write_plots(out, results)
    lines = [f"# Search report: {spec.name}", "",
             f"Spec `{spec.path}`; measured on **{device_name}**; cost model ranked with "
             f"**{cost_device.name}** numbers ({cost_device.source}).", ""]
    if cost_device.name != device_name:
        lines += [f"> The spec names hardware `{cost_device.name}` but this ran on `{device_name}`: "
                  "rankings use the spec's numbers; every measured figure is from this device.", ""]
    lines += ["| | config | tok/s | speedup over AR |", "|---|---|---|---|",
              f"| AR | plain autoregressive | {ar:.1f} | 1.00x |",
              f"| stock | {_label(stock['config'])} | {stock['tokens_per_s']:.1f} | "
              f"{stock['tokens_per_s'] / ar:.2f}x |",
              f"| found | {_label(inc['config'])} | {inc['tokens_per_s']:.1f} | {inc['tokens_per_s'] / ar:.2f}x |",
              "", f"Measurements used: {state.measurements} (pilots included). Rounds: {len(state.history)}.", "",
              "Cost model on the validated candidates: " + _fidelity_text(results["cost_model_fidelity"]), "",
              *[f"![{p.stem}]({p.name})" for p in plots], "",
              "## Rounds", "", "| round | directions | screened | incumbent tok/s | predicted | ceiling |",
              "|---|---|---|---|---|---|"]
    for h in state.history:
        lines.append(f"| {h['round']} | {', '.join(h['directions'])} | {h['screened']} | "
                     f"{h['incumbent_tokens_per_s']:.1f} | {h['predicted_tokens_per_s']:.1f} | "
                     f"{h['ceiling_tokens_per_s']:.1f} |")
    lines += ["", "## Every measured candidate", "", "| round | config | tok/s | speedup | tau | verdict |",
              "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
        verdict = "validated" if r["rejected"] is None else "rejected: " + r["rejected"][:120]
        lines.append(f"| {r['round']} | {_label(r['config'])} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['tau']:.2f} | {verdict} |")
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _fidelity_text(f: dict) -> str:
    if not f["configs"] or f["median_relative_error"] is None:
        return "no validated candidate to compare."
    rho = "n/a" if f["spearman"] is None else f"{f['spearman']:.2f}"
    return (f"median relative error {f['median_relative_error'] * 100:.1f}%, Spearman {rho} "
            f"over {f['configs']} configs (predicted vs measured tok/s).")
