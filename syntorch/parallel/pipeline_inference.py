"""Pipeline-parallel generation as FasterTransformer runs it (ParallelGpt / GptJ, `pipeline_para_size`).

Each rank holds one stage: contiguous layers (pipeline.stage_layers), the embedding on the first stage, the
final norm and head on the last, and KV caches for its own layers only. Every step (the prefill, then each
decode step) runs the batch as micro-batches, which flow through the stages: the first stage embeds
micro-batch m and sends its residual stream on (point-to-point send/recv between neighbouring stages) while
it starts on m + 1; the last stage runs the head, and once every micro-batch is through it chooses the next
tokens (greedy, sampling, beam search) and **broadcasts** them over the stage chain, as FasterTransformer
broadcasts `output_ids`, `finished` and, for beam search, the cache indirection from the last pipeline rank
each step: every stage needs the tokens (the first embeds them) and whether generation ended.

How many micro-batches: FasterTransformer's `getLocalBatchSize(batch, seq_len, pp)` (utils/nccl_utils.cc):
split the batch into pp micro-batches when it divides by pp, then keep halving a micro-batch while it holds
more than 1024 tokens (batch rows × tokens this step) and stays even. So the prefill of long prompts runs
smaller micro-batches than the decode steps (one token per row): pp micro-batches keep every stage busy
once the pipe is full, and the 1024-token cap bounds a micro-batch's activation buffers. A batch that does
not divide by pp runs as one micro-batch (FasterTransformer's rule too). Beam search keeps a prompt row's
beams in one micro-batch (FasterTransformer's local_batch_size * beam_width).

Activations of the n-th micro-batch a stage sends in the whole generation travel with tag 2n
(pipeline.tag), so every send meets exactly one recv with the same peer and tag, in order. Under TP each TP
rank of a stage sends to the same TP rank of the next stage, and the chain groups are the mesh's pp groups.
"""
import torch
import torch.distributed as dist

from syntorch.errors import UserError
from syntorch.parallel import distributed as comm
from syntorch.parallel import pipeline as pp_
from syntorch.parallel.mesh import Mesh, MeshGroups

TOKENS_PER_MICROBATCH = 1024  # FasterTransformer halves micro-batches above this many tokens


def microbatch_rows(batch: int, seq_len: int, pp: int) -> int:
    """Prompt rows per micro-batch: FasterTransformer's getLocalBatchSize (module docstring)."""
    rows = batch // pp if pp > 1 and batch % pp == 0 else batch
    while pp > 1 and rows * seq_len > TOKENS_PER_MICROBATCH and rows % 2 == 0:
        rows //= 2
    return rows


def check_pipeline(config, pp: int, sequence_parallel: bool) -> None:
    """What pipeline inference needs, in one line each."""
    if pp == 1:
        return
    if config.encoder:
        raise UserError(f"--pp splits a decoder's generation into stages; {config.name} is an encoder "
                        "(one pass), run it without --pp")
    if sequence_parallel:
        raise UserError("--sp with --pp is not supported for inference (a stage cannot tell whether a received "
                        "decode step was split); drop --sp")
    pp_.stage_layers(config.n_layer, pp)


def chain_group(mesh: Mesh, only_mine: bool = False):
    """This rank's pp group (its stage chain), created collectively (every rank calls it, after
    mesh.init_groups); `only_mine` (symbolic runs) creates just this rank's."""
    rank, mine = dist.get_rank(), None
    for chain in mesh.groups("pp"):
        if only_mine and rank not in chain:
            continue
        group = dist.new_group(chain)
        if rank in chain:
            mine = group
    return mine


def stage_of(groups: MeshGroups, n_layer: int) -> pp_.Stage:
    pp = groups.mesh.pp
    return pp_.Stage(groups.stage, pp, pp_.stage_layers(n_layer, pp)[groups.stage])


class PipelineForward:
    """generate's forward (generate.LocalForward) on one pipeline stage: micro-batches through this stage,
    logits on the last stage only, the choice broadcast from the last stage to every stage."""

    def __init__(self, groups: MeshGroups, chain, n_layer: int, beam_width: int = 1):
        self.groups, self.chain, self.beam_width = groups, chain, beam_width
        self.stage = stage_of(groups, n_layer)
        mesh, rank = groups.mesh, groups.rank
        self.last_rank = mesh.group(rank, "pp")[-1]
        self.sent = 0  # micro-batches this stage has passed on (or received), numbering their tags
        self.device = None  # the model's (meta when symbolic, cuda for NCCL): the broadcasts' too

    def logits(self, model, idx: torch.Tensor, start: int, inputs: dict) -> torch.Tensor | None:
        """[R, V] logits of the last position of every row on the last stage; None on the others."""
        R, T = idx.shape
        size = microbatch_rows(R // self.beam_width, T, self.stage.count) * self.beam_width
        param = next(model.parameters())
        self.device, outs, sends = param.device, [], []
        for r0 in range(0, R, size):
            rows = slice(r0, r0 + size)
            with model.cache_rows(rows):  # the prefill's micro-batches may be smaller than the decode's
                if self.stage.first:
                    x = idx[rows]
                else:
                    shape = (size, T, model.config.d_model)
                    x = pp_.recv_forward(shape, param.dtype, param.device, self.groups, self.sent)
                y = pp_.stage_forward(model, x, start=start, last_only=True,
                                      **{k: v[rows] for k, v in inputs.items()})
                sends.append(pp_.send_forward(y, self.groups, self.sent))
            self.sent += 1
            if self.stage.last:
                outs.append(y[:, -1])
        pp_.wait_sends(sends)  # every micro-batch on its way before this stage waits on the chosen tokens
        return torch.cat(outs) if self.stage.last else None

    def share(self, choice: tuple | None, sizes: list[int]) -> tuple:
        """The last stage's choice (1-D long tensors of `sizes`) on every stage of the chain."""
        if self.stage.last and choice is None:  # meta's beam search: no values to choose from, the same traffic
            choice = tuple(torch.zeros(n, dtype=torch.long, device=self.device) for n in sizes)
        flat = self._broadcast(torch.cat(choice) if self.stage.last else None, sum(sizes))
        return tuple(flat.split(sizes))

    def share_rows(self, rows: list[list[int]] | None, batch: int, width: int) -> list[list[int]]:
        """Sequences (at most `width` ids each) known on the last stage, on every stage."""
        packed = None
        if self.stage.last:
            packed = torch.zeros(batch, width + 1, dtype=torch.long)
            for b, row in enumerate(rows):
                packed[b, 0] = len(row)
                packed[b, 1:1 + len(row)] = torch.tensor(row)
        packed = self._broadcast(None if packed is None else packed.view(-1), batch * (width + 1)).view(batch, -1)
        return [row[1:1 + row[0]] for row in packed.tolist()]

    def _broadcast(self, flat: torch.Tensor | None, numel: int) -> torch.Tensor:
        """flat (long) from the last stage; the same values out on every stage (on CPU unless symbolic)."""
        device = self.device
        buf = torch.empty(numel, dtype=torch.long, device=device) if flat is None else flat.to(device)
        comm.broadcast(buf, self.last_rank, self.chain)
        return buf if device.type == "meta" else buf.cpu()
