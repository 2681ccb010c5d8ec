"""What the engine holds for one tiled pass (``compile.tiled_loss``, ``compile.tiled_mlp``).

Both passes have the same engine-side state: the configured chunk size, the
:class:`~deepcompile.passes.tiling_choice.TilingChoice` that decides each site, and a running
count of the sites replaced. Only the function that rewrites a graph differs
(``tiled_loss.tile_losses``, ``tiled_mlp.tile_mlps``), so one class takes it as an argument.
"""

from __future__ import annotations

from typing import Callable

from torch.fx import GraphModule

from deepcompile.passes.tiling_choice import TilingChoice

# (graph, configured chunk tokens, choice) -> how many sites it replaced.
TileFn = Callable[[GraphModule, int, TilingChoice], int]


class TiledPass:
    """One engine's tiled pass: run over each captured graph, it counts the sites it has replaced
    (``replaced``); under "planned" ``choice`` also counts the ones it left. The engine refuses to
    train on when the option is ``true`` and nothing was replaced."""

    def __init__(self, tile: TileFn, configured_chunk: int, choice: TilingChoice = None):
        self.tile = tile
        self.configured_chunk = configured_chunk
        self.choice = choice if choice is not None else TilingChoice(True)
        self.replaced = 0

    def rewrite(self, gm: GraphModule) -> int:
        count = self.tile(gm, self.configured_chunk, self.choice)
        self.replaced += count
        return count
