"""Lightning's ``DeepSpeedStrategy`` fitting a tiny module on deepcompile (served as ``deepspeed``),
run by tests/integrations/test_served_lightning.py under torchrun on gloo ranks (or, with
``--accelerator cuda``, on NCCL with Lightning's unmodified strategy).

Lightning refuses any accelerator but CUDA in ``DeepSpeedStrategy.setup_environment`` (a check,
nothing else: the strategy's config, ``deepspeed.initialize``, backward, step and teardown are the
same on the CPU), so the worker's strategy skips only that check. After ``fit`` every rank gathers
the parameters (``deepspeed.zero.GatheredParameters``) and rank 0 writes them to --out."""

import deepcompile

deepcompile.serve_as_deepspeed()  # before Lightning imports deepspeed

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402
from lightning.pytorch.strategies.parallel import ParallelStrategy  # noqa: E402

from lightning_case import LR, PER_RANK_BATCH, STEPS, build_net, data  # noqa: E402  (this folder is on sys.path)


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy minus its CUDA-only check."""

    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = build_net()

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: Lightning's own DeepSpeedStrategy on NCCL, one GPU per rank")
    args = p.parse_args()
    x, y = data()
    module = Tiny()
    strategy = (DeepSpeedStrategy(stage=args.stage) if args.accelerator == "cuda"
                else CPUDeepSpeedStrategy(stage=args.stage, process_group_backend="gloo"))
    trainer = pl.Trainer(accelerator=args.accelerator, devices=2, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, strategy=strategy)
    # Each rank its own rows, dealt round robin (rows r, r + 2, ...): step k trains on rows
    # 8k .. 8k + 7 over the two ranks, which is what the test's reference trains on.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    mine = torch.utils.data.TensorDataset(x[rank::world], y[rank::world])
    loader = torch.utils.data.DataLoader(mine, batch_size=PER_RANK_BATCH)
    trainer.fit(module, loader)
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        state = {name: p.detach().cpu().clone() for name, p in module.named_parameters()}
    if trainer.global_rank == 0:
        torch.save({"state": state, "engine": type(trainer.strategy.model).__module__}, args.out)


if __name__ == "__main__":
    main()
