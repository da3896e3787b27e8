"""`score-worker make-tiny-model`: a text model (models/tiny.py) or, with --images, an image-text one."""

from __future__ import annotations

import argparse

from models import tiny
from models.tiny_vision import write_tiny_qwen_vl_judge, write_tiny_vision_model

VISION_ARCHITECTURES = ("gemma3", "qwen2_5_vl", "qwen3_vl", "qwen3_5")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The text models' arguments, the image-text architectures among the choices, and --images."""
    tiny.add_arguments(parser, VISION_ARCHITECTURES)
    parser.add_argument(
        "--images",
        action="store_true",
        help="an image-text model with its processor, scored on requests that carry images (--architecture "
        "gemma3: a classifier, Gemma 3's vision tower and projector; qwen2_5_vl, qwen3_vl: judges, scored "
        "on label_token_ids, with Qwen2.5-VL's or Qwen3-VL's vision tower and merger; qwen3_5: Qwen3-VL's "
        "tower before Qwen3.5's hybrid text model, a judge with --judge, else a classifier of --num-labels)",
    )


def run(args: argparse.Namespace) -> int:
    """Write the tiny model; returns the process exit code."""
    vision = args.architecture in VISION_ARCHITECTURES
    if args.images != vision:
        print(
            f"--images goes with --architecture {', '.join(VISION_ARCHITECTURES)} (the image-text models), "
            "and they with --images"
        )
        return 2
    if not vision:
        return tiny.run(args)
    if args.architecture != "gemma3":
        if args.prm:
            print(f"--prm is for text decoders; the {args.architecture} model is a judge")
            return 2
        if args.architecture == "qwen3_5" and not args.judge:
            if args.num_labels < 1:
                print("--num-labels must be at least 1")
                return 2
            target = write_tiny_qwen_vl_judge(
                args.directory, args.seed, "qwen3_5", num_labels=args.num_labels
            )
            labels = f"{args.num_labels} label(s)"
            print(f"wrote a tiny qwen3_5 image-text classifier ({labels}), seed {args.seed}, to {target}")
            return 0
        target = write_tiny_qwen_vl_judge(args.directory, args.seed, args.architecture)
        print(f"wrote a tiny {args.architecture} image-text judge, seed {args.seed}, to {target}")
        return 0
    if args.judge or args.prm:
        print("--judge and --prm are for text decoders; the gemma3 image-text model is a classifier")
        return 2
    if args.num_labels < 1:
        print("--num-labels must be at least 1")
        return 2
    target = write_tiny_vision_model(args.directory, args.seed, args.num_labels)
    print(f"wrote a tiny gemma3 image-text model ({args.num_labels} label(s)), seed {args.seed}, to {target}")
    return 0
