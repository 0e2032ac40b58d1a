"""`atomtrain export RUN --format hf OUT`: a trained model in the format other tools load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a run's model and tokenizer for transformers (from_pretrained)",
    )
    p.add_argument("path", type=Path, help="run directory or checkpoint directory")
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument(
        "--format",
        choices=["hf"],
        default="hf",
        help="hf: config.json, model.safetensors, tokenizer.json (our GPT as GPT-2)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it holds files")
    p.set_defaults(func=run)


def _source_dir(run_dir: Path, tokenizer_kind: object) -> Path | None:
    """The transformers directory a run fine-tuned, when its tokenizer was the one used."""
    try:
        hf = json.loads((run_dir / "config.json").read_text())["model"].get("hf", "")
    except (OSError, json.JSONDecodeError, KeyError, AttributeError):
        return None
    return Path(hf) if hf and tokenizer_kind == "hf" and Path(hf).is_dir() else None


def run(args: argparse.Namespace, _extra: list[str]) -> int:
    from atomtrain.models.hf_export import export_hf
    from atomtrain.train.loading import load_trained
    from atomtrain.train.session import resolve_resume

    model, tok, ckpt = load_trained(args.path)
    run_dir, _ = resolve_resume(args.path)
    source = _source_dir(run_dir, tok.spec().get("kind"))
    out = export_hf(model, tok, args.out, source, overwrite=args.overwrite)
    print(f"wrote {out} from {ckpt} (load it with AutoModelForCausalLM.from_pretrained)")
    return 0
