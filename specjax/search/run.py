"""`specjax search SPEC`: load the spec, the target and the prompts, resolve the hardware, run the
loop, write the report."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from specjax.costmodel.hardware import current_device_name, resolve_hardware
from specjax.errors import ConfigError
from specjax.models.loading import load_model
from specjax.prompts import humaneval_prompts, read_prompts_file
from specjax.search.evaluate import Evaluator
from specjax.search.loop import Search
from specjax.search.proposers import make_proposer
from specjax.search.report import write_report
from specjax.search.spec import load_spec


def spec_prompts(spec) -> list[str]:
    d = spec.deployment
    if d.prompt_source == "humaneval":
        texts = humaneval_prompts(d.prompt_offset + d.prompt_n)[d.prompt_offset:]
    else:
        path = Path(d.prompt_file)
        if not path.is_absolute():
            path = Path(spec.path).parent / path
        texts = read_prompts_file(str(path))[d.prompt_offset:d.prompt_offset + d.prompt_n]
    if len(texts) < d.prompt_n:
        raise ConfigError(f"{spec.path}: deployment.prompts asks for {d.prompt_n} prompts, found {len(texts)}")
    return texts


def load_deployment(spec):
    """The spec's target and its tokenized prompts (the search process and every worker do this)."""
    target = load_model(spec.deployment.target, dtype=spec.deployment.dtype)
    if target.tokenizer is None:
        raise ConfigError(f"{spec.path}: target {spec.deployment.target!r} has no tokenizer")
    return target, [target.tokenizer.encode(t) for t in spec_prompts(spec)]


def check_engine_supports(spec):
    """Refuse, before loading anything, a space that moves engine knobs this build's Decoder does
    not take yet (weights_format, kernel_tiles): better one line now than a crash mid-search."""
    import inspect

    from specjax.engine import Decoder
    from specjax.search.evaluate import STOCK_ENGINE
    from specjax.search.registry import REGISTRY

    takes = inspect.signature(Decoder.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes.values()):
        return
    for mechanism in ("weights", "kernels"):  # the mechanisms that set engine knobs
        m = REGISTRY.mechanisms[mechanism]
        for name in (p.name for p in m.params if p.name in spec.space):
            param = spec.space[name]
            for value in param.values:
                kw = m.apply({name: value})
                for knob, stock in STOCK_ENGINE.items():
                    if kw.get(knob, stock) != stock and knob not in takes:
                        raise ConfigError(f"{spec.path}:{param.line}: space.{name}: {value!r} needs an "
                                          f"engine that takes {knob}=, and this build's Decoder does not (yet)")


def run_search(spec_path: str, output: str | None = None, resume: bool = False, agents: int | None = None,
               proposer: str | None = None, memory_dir: str = "memory_store", progress=print,
               evaluator_factory=None, evaluator: str | None = None):
    """evaluator_factory: a callable with Evaluator's signature (in-process only) or a
    'package.module:attr' path (any evaluator kind; workers import it); evaluator: override the
    spec's evaluator.kind."""
    from specjax.memory.store import MemoryStore

    spec = load_spec(spec_path)
    if evaluator is not None:
        spec = dataclasses.replace(spec, evaluator=dataclasses.replace(spec.evaluator, kind=evaluator))
    remote = spec.evaluator.kind != "inprocess"
    if remote:  # workers share the GPUs with this process: nobody may grab most of a GPU up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = Path(output or spec.output)
    out.mkdir(parents=True, exist_ok=True)
    device_name = current_device_name()
    cost_device = resolve_hardware(spec.deployment.hardware, memory_dir)
    same = cost_device.name == device_name or (cost_device.name.startswith("cpu") and device_name.startswith("cpu"))
    if not same:
        progress(f"note: {spec_path} names hardware {cost_device.name!r} but this machine is {device_name!r}: "
                 f"candidates are ranked with {cost_device.name}'s numbers and measured on {device_name}; "
                 "every figure is labeled with the device it came from")
    check_engine_supports(spec)
    target, prompts = load_deployment(spec)
    lh12_bits = None
    if any(name.startswith("weights.") for name in spec.space):  # the cost model's bytes per group
        from specjax.costmodel.weight_bits import lh12_group_bits
        lh12_bits = lh12_group_bits(target.params)
        progress("LH12 bits per weight of the target: " +
                 ", ".join(f"{g} {b:.2f}" for g, b in zip(("attn", "mlp", "head"), lh12_bits)))
    if same:  # ranking numbers for this very device: fit the fixed cost and skinny-matmul rate to the target
        from specjax.costmodel.hardware import fit_to_target
        cost_device = fit_to_target(cost_device, target.cfg, target.params)
        progress(f"cost model: {cost_device.bandwidth / 1e9:.1f} GB/s, {cost_device.flops / 1e9:.1f} GFLOP/s "
                 f"effective, {cost_device.step_overhead * 1e3:.3f} ms per forward + "
                 f"{cost_device.layer_overhead * 1e6:.1f} us per layer ({cost_device.source})")
    if remote:
        from specjax.search.workers import remote_evaluator
        if evaluator_factory is not None and not isinstance(evaluator_factory, str):
            raise ValueError("an out-of-process evaluator needs the factory as a 'package.module:attr' path")
        evaluator = remote_evaluator(spec, target, prompts, cost_device, device_name, out, evaluator_factory)
        progress(f"evaluator: {spec.evaluator.kind}, {len(evaluator.handles)} workers, "
                 f"{spec.evaluator.timeout_s:.0f} s per candidate")
    else:
        factory = evaluator_factory or Evaluator
        if isinstance(factory, str):
            from specjax.search.workers import resolve_factory
            factory = resolve_factory(factory)
        evaluator = factory(target, prompts, spec.deployment.max_new_tokens, cost_device, device_name,
                            spec.forcing_tolerance, spec.floor_tolerance, batch=spec.deployment.batch)
    evaluator.lh12_bits = lh12_bits
    evaluator.tp = spec.deployment.tp
    search = Search(spec, evaluator, make_proposer(spec, proposer), out, memory=MemoryStore(memory_dir),
                    agents=agents, progress=progress, refit_from_ar=same)
    try:
        state = search.run(resume=resume)
    finally:
        evaluator.close()
    report = write_report(out, spec, state, device_name, cost_device)
    ar = state.ar["tokens_per_s"]
    progress(f"done: stock {state.stock['tokens_per_s'] / ar:.2f}x, found {state.incumbent['config']} "
             f"{state.incumbent['tokens_per_s'] / ar:.2f}x over AR ({ar:.1f} tok/s on {device_name}); "
             f"{state.measurements} measurements; report {report}")
    return state
