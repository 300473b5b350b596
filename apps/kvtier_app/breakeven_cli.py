"""`kvtier breakeven`: the tier economics of one model on one machine.

Bad input (unknown preset, zero or negative numbers, missing shape) exits 2 with
a message naming the flag; nothing else is printed.
"""
from __future__ import annotations

import argparse
import math
import sys

from kvtier import breakeven, presets
from kvtier.dtypes import DEFAULT_KV_DTYPE
from kvtier.presets import Medium, ModelShape


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        shape = _shape(args)
        tflops, gpu_name = _gpu(args)
        report = breakeven.evaluate(
            shape, tflops_per_gpu=tflops, tp=args.tp, kv_dtype=args.kv_dtype, traffic=args.traffic,
            concurrency=args.concurrency, media=_media(args.medium), kv_bytes_override=args.kv_bytes_per_token,
            prefix_tokens=args.prefix_tokens, gpu_name=gpu_name,
        )
    except ValueError as e:  # _FlagError names its flag; evaluate's errors name the argument
        parser.error(str(e))  # exits 2
    if args.json:
        print(report.model_dump_json(indent=2))
    else:
        print(_render(report))
    return 0


class _FlagError(ValueError):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier breakeven",
        description="Break-even fetch bandwidth: fetch a prefix's KV only from media faster than recompute.",
    )
    shape = p.add_argument_group("model (a preset, or the shape; shape flags override a preset)")
    shape.add_argument("--model", help=f"preset: {', '.join(presets.MODELS)}")
    shape.add_argument("--layers", type=_pos_int("--layers"))
    shape.add_argument("--kv-heads", type=_pos_int("--kv-heads"))
    shape.add_argument("--head-dim", type=_pos_int("--head-dim"))
    shape.add_argument("--params", type=_pos_float("--params"), help="parameters, e.g. 70e9")
    shape.add_argument("--active-params", type=_pos_float("--active-params"), help="MoE: active per token")
    shape.add_argument("--kv-bytes-per-token", type=_pos_int("--kv-bytes-per-token"),
                       help="override the shape's KV bytes per token (e.g. MLA); ignores --kv-dtype")
    shape.add_argument("--kv-dtype", choices=sorted(breakeven.KV_DTYPE_BYTES), default=DEFAULT_KV_DTYPE.value)
    hw = p.add_argument_group("hardware")
    hw.add_argument("--gpu", help=f"preset: {', '.join(presets.GPUS)} (default h100 unless --tflops)")
    hw.add_argument("--tflops", type=_pos_float("--tflops"), help="dense TFLOP/s per GPU (never the sparsity figure)")
    hw.add_argument("--tp", type=_pos_int("--tp"), default=1, help="tensor-parallel degree")
    hw.add_argument("--medium", action="append", default=[], type=_medium_flag, metavar="NAME=GBPS",
                    help="add or override a medium (repeatable)")
    p.add_argument("--traffic", choices=["interactive", "batch"], default="interactive")
    p.add_argument("--concurrency", type=_pos_int("--concurrency"), default=1,
                   help="concurrent fetches sharing each medium")
    p.add_argument("--prefix-tokens", type=_pos_int("--prefix-tokens"), default=breakeven.DEFAULT_PREFIX_TOKENS)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _shape(args: argparse.Namespace) -> ModelShape:
    overrides = {
        k: v for k, v in (
            ("layers", args.layers), ("kv_heads", args.kv_heads), ("head_dim", args.head_dim),
            ("params", args.params), ("active_params", args.active_params),
        ) if v is not None
    }
    if args.model is not None:
        try:
            preset = presets.model_preset(args.model)
            return ModelShape(**{**preset.model_dump(), **overrides}, name=preset.name)
        except ValueError as e:
            raise _FlagError(f"--model: {e}") from None
    if "params" not in overrides:
        raise _FlagError("give --model PRESET, or the shape: --params and --layers --kv-heads --head-dim "
                         "(or --kv-bytes-per-token)")
    missing = [f"--{k.replace('_', '-')}" for k in ("layers", "kv_heads", "head_dim") if k not in overrides]
    if missing and args.kv_bytes_per_token is None:
        raise _FlagError(f"missing {', '.join(missing)} (or give --kv-bytes-per-token)")
    if args.active_params is not None and args.active_params > args.params:
        raise _FlagError("--active-params cannot exceed --params")
    return ModelShape(
        name="custom", layers=overrides.get("layers", 1), kv_heads=overrides.get("kv_heads", 1),
        head_dim=overrides.get("head_dim", 1), params=args.params, active_params=args.active_params,
    )


def _gpu(args: argparse.Namespace) -> tuple[float, str]:
    if args.gpu is not None and args.tflops is not None:
        raise _FlagError("give --gpu or --tflops, not both")
    if args.tflops is not None:
        return args.tflops, "custom"
    try:
        gpu = presets.gpu_preset(args.gpu or "h100")
    except ValueError as e:
        raise _FlagError(f"--gpu: {e}") from None
    return gpu.dense_tflops, gpu.name


def _media(custom: list[Medium]) -> list[Medium]:
    media = dict(presets.MEDIA)
    for m in custom:
        media[m.name] = m
    return list(media.values())


def _pos_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a whole number > 0, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{flag} must be > 0, got {text!r}")
        return value
    return parse


def _pos_float(flag: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number > 0, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{flag} must be a finite number > 0, got {text!r}")
        return value
    return parse


def _medium_flag(text: str) -> Medium:
    name, sep, gbps = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"--medium must look like NAME=GBPS, got {text!r}")
    return Medium(name.strip(), _pos_float(f"--medium {name.strip()}")(gbps))


def _render(r: breakeven.BreakEvenReport) -> str:
    mib = r.prefix_bytes / 2**20
    lines = [
        f"model {r.model} (recompute {r.recompute_params / 1e9:g}B params), {r.gpu} "
        f"{r.tflops_per_gpu:g} dense TFLOP/s x TP{r.tp}, KV {r.kv_dtype}, {r.traffic} traffic, "
        f"concurrency {r.concurrency}",
        f"kv_bytes_per_token   {r.kv_bytes_per_token:,} B ({r.kv_bytes_per_token / 1024:,.0f} KiB)",
        f"prefill_us_per_token {r.prefill_us_per_token:.1f} us",
        f"break_even_gbps      {r.break_even_gbps:.2f} GB/s",
        f"a {r.prefix_tokens:,}-token prefix: {mib:,.0f} MiB of KV, {r.prefix_recompute_ms:.1f} ms to recompute",
        "",
        f"{'medium':<14}{'GB/s':>9}{'ratio':>8}  verdict",
    ]
    for m in r.media:
        eff = f"{m.effective_gbps:,.4g}" + ("*" if r.concurrency > 1 else "")
        lines.append(f"{m.name:<14}{eff:>9}{m.ratio:>7.1f}x  {m.verdict}: {m.reason}")
    if r.concurrency > 1:
        lines.append(f"* bandwidth per fetch with {r.concurrency} concurrent fetches sharing the medium")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
