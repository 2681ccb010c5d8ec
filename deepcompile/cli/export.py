"""``deepcompile export CKPT_DIR OUT_DIR [--tag T] [--dtype auto|bf16|fp16|fp32]``: a checkpoint
of ``engine.save_checkpoint`` (any world size, any ZeRO stage) as one Hugging Face safetensors
folder, in one process, without GPUs or a process group: what DeepSpeed's ``zero_to_fp32.py`` is
to its users.

The folder holds ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` files and their
index, ``--max-shard-size``), named by the module's ``state_dict`` names, and, when the
checkpoint carries one (transformers models: ``save_checkpoint`` writes it), ``config.json`` with
the exported dtype, so that ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it; else
``--config`` names one to copy. Parameters are the fp32 master weights cast to ``--dtype``
(``auto``: the dtype the model trained in, bf16 or fp16 from the saved config, else as stored);
buffers keep their dtype. The checkpoint is read a batch of parameters at a time
(checkpoint/offline.py): memory holds a batch and one output file, not the model.

Tied parameters are stored once, under the name the checkpoint has (``from_pretrained`` ties
them again from the config). With a ``config.json`` and transformers installed, the model is
built on the meta device to learn how transformers stores it: parameters it keeps in another
form in its files (Qwen2-MoE's fused experts, checkpoint/hf_layout.py) are written in that form,
as ``save_pretrained`` and ``engine.save_hf`` write them; without one, in the module's names.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a safetensors folder, offline (no GPU, no process group)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="the save_dir given to engine.save_checkpoint")
    p.add_argument("out", help="the folder to write (created; must be empty unless --overwrite)")
    p.add_argument("--tag", help="the checkpoint's tag (default: the one 'latest' names)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="dtype of the parameters (default auto)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--config", help="a config.json (or model folder) to copy when the checkpoint has none")
    p.add_argument("--overwrite", action="store_true", help="replace the weights of an earlier export in OUT")


def _config_source(ckpt_path: str, given) -> str:
    if given:
        return os.path.join(given, "config.json") if os.path.isdir(given) else given
    return os.path.join(ckpt_path, "config.json")


def _write_config(source: str, out: str, dtype) -> bool:
    if not os.path.isfile(source):
        return False
    with open(source, encoding="utf-8") as f:
        config = json.load(f)
    if dtype is not None:
        # transformers 5 reads "dtype", earlier versions "torch_dtype": set whichever is there.
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
        for k in keys:
            config[k] = str(dtype).replace("torch.", "")
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    generation = os.path.join(os.path.dirname(source), "generation_config.json")
    if os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(out, "generation_config.json"))
    return True


def _conversions(config_file: str):
    """transformers' weight conversions for the model ``config_file`` describes ([] without
    transformers or a config). The model is built on the meta device: no memory, no weights."""
    if not os.path.isfile(config_file):
        return []
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return []
    from deepcompile.checkpoint.hf_layout import transformers_conversions

    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(config_file)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return transformers_conversions(model)


def _stored_form(name: str, value, conversions):
    """The tensors ``save_pretrained`` writes for parameter ``name``."""
    from deepcompile.checkpoint.hf_layout import conversion_for

    conversion = conversion_for(name, conversions)
    if conversion is None:
        return [(name, value)]
    if conversion.unsupported:
        raise SystemExit(f"deepcompile export: transformers stores {name} converted in a way this export cannot "
                         f"write ({conversion.unsupported}); use engine.save_hf")
    return list(conversion.split(name, value))


def _prepare(out: str, overwrite: bool) -> None:
    from deepcompile.checkpoint.safetensors_files import is_weights_file

    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"{out} exists and is not a folder")
    entries = os.listdir(out) if os.path.isdir(out) else []
    if entries and not overwrite:
        raise SystemExit(f"{out} is not empty: pass --overwrite to replace the weights of an earlier export there")
    for name in entries:
        if is_weights_file(name):
            os.remove(os.path.join(out, name))


def run(args) -> int:
    import torch

    from deepcompile import logging_setup, progress
    from deepcompile.checkpoint.agreement import CheckpointError
    from deepcompile.checkpoint.offline import OfflineCheckpoint
    from deepcompile.checkpoint.safetensors_files import ShardedWriter, parse_size

    try:
        ckpt = OfflineCheckpoint(args.checkpoint, args.tag)
        max_bytes = parse_size(args.max_shard_size)
    except (CheckpointError, ValueError) as e:
        print(f"deepcompile export: {e}", file=sys.stderr)
        return 1
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype != "auto" else ckpt.training_dtype()
    print(f"reading {ckpt.describe()}")
    config_file = _config_source(ckpt.path, args.config)
    conversions = _conversions(config_file)
    _prepare(args.out, args.overwrite)
    os.makedirs(args.out, exist_ok=True)
    # Written aside, then moved in: an export that fails leaves no half-written weights in OUT.
    staging = tempfile.mkdtemp(prefix=".export-", dir=args.out)
    try:
        writer = ShardedWriter(staging, max_bytes)
        count = total = 0
        logging_setup.show_progress(0)  # the heartbeat of a long export, on stderr
        with progress.long_operation(f"exporting {ckpt.path}", show=True) as shown:
            for stored, value in ckpt.read():
                if stored.is_parameter and dtype is not None and value.is_floating_point():
                    value = value.to(dtype)
                for name, piece in (_stored_form(stored.name, value, conversions) if stored.is_parameter
                                    else [(stored.name, value)]):
                    writer.add(name, piece)
                    count += 1
                total += value.numel() if stored.is_parameter else 0
            shown["done"] = f"read {count} tensors of {ckpt.path}"
        files = writer.finish(total)
        for name in files:
            os.replace(os.path.join(staging, name), os.path.join(args.out, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    wrote_config = _write_config(config_file, args.out, dtype)
    print(f"wrote {count} tensors ({total:,} parameters, {writer.total_bytes / 2**30:.2f} GiB"
          + (f", parameters in {str(dtype).replace('torch.', '')}" if dtype is not None else "")
          + f") to {args.out}: {', '.join(files)}" + (", config.json" if wrote_config else ""))
    if not wrote_config:
        print("no config.json: the checkpoint carries none (not a transformers model?); pass --config to add one "
              "for from_pretrained", file=sys.stderr)
    return 0
