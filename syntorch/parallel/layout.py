"""How many layers each pipeline stage (and, interleaved, each of its V chunks) holds: Megatron-Core's uneven
splits, with the same meanings (megatron/core/transformer/transformer_layer.py, get_transformer_layer_offset,
and transformer_block.py, get_num_layers_to_build):

- `first` / `last` (--first_stage_layers / --last_stage_layers; Megatron's --decoder-first-pipeline-num-layers
  / --decoder-last-pipeline-num-layers): the first (last) stage holds that many layers, the other stages
  share the rest evenly. Interleaved, every stage's count is cut into V equal chunks, so V must divide each.
- `embedding` / `loss` (--account_for_embedding / --account_for_loss; Megatron's
  --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split): the embedding (the loss)
  counts as one more layer, the L + 1 (+ 1) are cut into pp·V equal chunks, and the chunk holding the
  embedding (chunk 0 of the first stage) or the loss (the last chunk of the last stage) takes one
  Transformer layer fewer. Megatron refuses these together with first/last; so does syntorch.

Layers are dealt to the chunks in Megatron's order, chunk-major: chunk 0 of stages 0..pp-1, then chunk 1, ...
A chunk left without a layer (Megatron's --pipeline-model-parallel-layout allows an embedding-only one) is
refused here: syntorch's chunks each run at least one layer.
"""
from dataclasses import dataclass

from syntorch.errors import UserError


@dataclass(frozen=True)
class Layout:
    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False

    @property
    def even(self) -> bool:
        """No option given: syntorch's own even split (pipeline.stage_chunks)."""
        return self.first is None and self.last is None and not self.embedding and not self.loss


def check_layout(layout: Layout, pp: int) -> None:
    """What does not depend on the model: counts positive, the two kinds of option apart, a pipeline."""
    if layout.even:
        return
    for name, value in (("first_stage_layers", layout.first), ("last_stage_layers", layout.last)):
        if value is not None and value < 1:
            raise UserError(f"--{name} must be at least 1, got {value}")
    if (layout.first is not None or layout.last is not None) and (layout.embedding or layout.loss):
        raise UserError("--first_stage_layers/--last_stage_layers and --account_for_embedding/--account_for_loss "
                        "are two ways to even out the pipeline's ends; use one (Megatron-Core refuses both too)")
    if pp < 2:
        raise UserError("--first_stage_layers, --last_stage_layers, --account_for_embedding and --account_for_loss "
                        "split layers over pipeline stages; they need --pp > 1")


def chunk_sizes(n_layer: int, pp: int, virtual: int, layout: Layout) -> list[list[int]]:
    """Layers per chunk, [stage][chunk], of an uneven layout (module docstring)."""
    sizes = (_ends_sizes(n_layer, pp, virtual, layout) if layout.first is not None or layout.last is not None
             else _accounted_sizes(n_layer, pp, virtual, layout))
    for s, stage in enumerate(sizes):
        if 0 in stage:
            raise UserError(f"chunk {stage.index(0)} of stage {s} would hold no Transformer layer with --virtual_stages "
                            f"{virtual}; lower --virtual_stages")
    return sizes


def _ends_sizes(n_layer: int, pp: int, virtual: int, layout: Layout) -> list[list[int]]:
    ends = [x for x in (layout.first, layout.last) if x is not None]
    middle_stages, middle = pp - len(ends), n_layer - sum(ends)
    given = " and ".join(f"--{name} {x}" for name, x in (("first_stage_layers", layout.first),
                                                        ("last_stage_layers", layout.last)) if x is not None)
    if middle < 0 or (middle_stages == 0 and middle) or (middle_stages and middle % middle_stages):
        raise UserError(f"{given} leave {middle} of the model's {n_layer} layers for {middle_stages} other stage(s) "
                        f"of --pp {pp}; the stage counts must sum to {n_layer} with the other stages equal")
    per = middle // middle_stages if middle_stages else 0
    if middle_stages and per == 0:
        raise UserError(f"{given} leave no layer for the other {middle_stages} stage(s) of --pp {pp}")
    counts = [per] * pp
    counts[0] = per if layout.first is None else layout.first
    counts[-1] = per if layout.last is None else layout.last
    if any(c % virtual for c in counts):
        raise UserError(f"--virtual_stages {virtual} must divide every stage's layers (first {counts[0]}, others "
                        f"{per}, last {counts[-1]} with {given}); pick counts or a V that divide them, or count "
                        "the ends with --account_for_embedding/--account_for_loss")
    return [[c // virtual] * virtual for c in counts]


def _accounted_sizes(n_layer: int, pp: int, virtual: int, layout: Layout) -> list[list[int]]:
    total = n_layer + layout.embedding + layout.loss
    if total % (pp * virtual):
        raise UserError(f"{n_layer} layers with the embedding and loss counted ({total}) do not divide into "
                        f"--pp {pp} x --virtual_stages {virtual} = {pp * virtual} equal chunks")
    sizes = [[total // (pp * virtual)] * virtual for _ in range(pp)]
    sizes[0][0] -= layout.embedding
    sizes[-1][-1] -= layout.loss
    return sizes


def chunk_ranges(sizes: list[list[int]]) -> list[tuple[range, ...]]:
    """Each stage's chunks as layer ranges, dealt chunk-major (chunk 0 of every stage first), as Megatron does."""
    pp, virtual = len(sizes), len(sizes[0])
    out = [[None] * virtual for _ in range(pp)]
    start = 0
    for c in range(virtual):
        for s in range(pp):
            out[s][c] = range(start, start + sizes[s][c])
            start += sizes[s][c]
    return [tuple(chunks) for chunks in out]
