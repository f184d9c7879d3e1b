"""Beam search's bookkeeping as HuggingFace does it (generate.py runs the steps, this chooses between them)."""
import torch


class Beams:
    """HuggingFace's beam search (transformers 4.57 `_beam_search` with length_penalty 1.0, early_stopping
    False), step for step, so that ties and scores resolve the same way. Per prompt row it keeps N running
    hypotheses and the N best finished ones; a hypothesis finishes on a stop token or at max_len."""

    def __init__(self, prompt: torch.Tensor, n: int, max_len: int, stop_tokens: torch.Tensor):
        B, T = prompt.shape
        self.n, self.max_len, self.prompt_len, self.cur_len = n, max_len, T, T
        self.stop_tokens = stop_tokens
        self.keep = max(2, 1 + len(stop_tokens)) * n  # enough candidates that n survive even if all stop
        self.running = torch.zeros(B, n, max_len, dtype=torch.long)
        self.running[:, :, :T] = prompt[:, None]
        self.running_scores = torch.zeros(B, n)
        self.running_scores[:, 1:] = -1e9  # all beams start equal: only the first may expand at step one
        self.finished = self.running.clone()
        self.finished_scores = torch.full((B, n), -1e9)
        self.finished_len = torch.zeros(B, n, dtype=torch.long)
        self.is_finished = torch.zeros(B, n, dtype=torch.bool)
        self.improvable = torch.ones(B, 1, dtype=torch.bool)  # can a running beam still beat the finished?
        self.chooses = False  # True once update ran here: on a pipeline only the last stage sees logits

    def update(self, logits: torch.Tensor):
        """logits [B*N, V] of every running beam -> (next token [B*N], cache row it continues [B*N])."""
        B, n, V = self.running.shape[0], self.n, logits.shape[-1]
        scores = (logits.log_softmax(-1).view(B, n, V) + self.running_scores[:, :, None]).view(B, n * V)
        top_scores, top_index = torch.topk(scores, self.keep)  # [B, K], best first
        source_beam, token = top_index // V, top_index % V
        candidates = gather(self.running, source_beam)
        candidates[:, :, self.cur_len] = token
        stops = torch.isin(token, self.stop_tokens) | (self.cur_len + 1 >= self.max_len)

        # the N best candidates that did not stop run on
        open_scores = top_scores + stops.float() * -1e9
        next_index = torch.topk(open_scores, n).indices
        self.running = gather(candidates, next_index)
        self.running_scores = gather(open_scores, next_index)
        rows = (gather(source_beam, next_index) + torch.arange(B)[:, None] * n).view(-1)

        self._add_finished(candidates, top_scores, stops)
        self.cur_len += 1
        generated = self.cur_len - self.prompt_len
        worst_finished = torch.where(self.is_finished, self.finished_scores.min(1, keepdim=True).values, -1e9)
        self.improvable &= (self.running_scores[:, :1] / generated > worst_finished).any(-1, keepdim=True)
        self.chooses = True
        done = ~self.improvable.any() | stops.all()
        return self.running[:, :, self.cur_len - 1].reshape(-1), rows, done.view(1).long()

    def _add_finished(self, candidates, top_scores, stops):
        """Among the top N candidates, those that stopped join the finished set if they beat its worst."""
        n = self.n
        new = stops.clone()
        new[:, n:] = False  # the candidates past the first N are only spares for the running set
        scores = top_scores / float(self.cur_len + 1 - self.prompt_len)  # length penalty 1.0
        scores = scores + (~self.improvable).float() * -1e9 + (~new).float() * -1e9
        merged_scores = torch.cat((self.finished_scores, scores), 1)
        best = torch.topk(merged_scores, n).indices
        self.finished = gather(torch.cat((self.finished, candidates), 1), best)
        self.finished_scores = gather(merged_scores, best)
        new_len = torch.full_like(new, self.cur_len + 1, dtype=torch.long)
        self.finished_len = gather(torch.cat((self.finished_len, new_len), 1), best)
        self.is_finished = gather(torch.cat((self.is_finished, new), 1), best)

    def best(self) -> list[list[int]]:
        return [seq[0, :length[0]].tolist() for seq, length in zip(self.finished, self.finished_len)]


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, M, ...] indexed along dim 1 by index [B, K] -> [B, K, ...]."""
    return torch.take_along_dim(x, index.view(*index.shape, *[1] * (x.dim() - 2)), dim=1)
