"""DUMP: a curriculum over data sources, a UCB bandit on |advantage| (arXiv 2504.09710).

Each data source (the distinct values of one example column) is an arm. How much a source still
teaches is estimated by the mean absolute advantage of its recent responses: a source the policy
has mastered, or cannot solve at all, gives groups with equal rewards and so advantages near 0.
A UCB bonus keeps rarely drawn sources in play, and a sharp softmax turns the scores into the
probability of drawing each source:

    mu_j  = mean |a| over the last `window` responses of source j      (0 before any data)
    UCB_j = mu_j + c * sqrt(2 ln(N + 1) / (n_j + 1)),   n_j = responses seen, N = sum_j n_j
    p_j   = softmax_j(UCB_j / temperature)

For each prompt slot a source is drawn from p, then a prompt uniformly, with replacement, from it.

Deviations from the official code (ZhentingWang/DUMP, verl/utils/curriculum_learning.py):
- Only training responses update the estimator; the official loop also feeds validation mean
  rewards into it as if they were advantages, which pollutes the windows.
- The Beta success counts and the 50-step weight trend it logs (they never affect sampling) are
  left out.
- Every source holds at least one example by construction, so the paper's renormalisation of p
  over non-empty sources is always the identity here.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

from torch import Tensor


def response_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """One scalar per response, Float[N]: the mean of its advantage over the tokens that count.

    `advantages` is Float[N] (sequence level: returned as is) or Float[N, T] (token level: averaged
    over `mask`, Bool[N, T]). A token-level response with no counted token has no mean: refused.
    """
    if advantages.dim() == 1:
        return advantages.detach().float()  # [N]
    if advantages.dim() != 2 or advantages.shape != mask.shape:
        raise ValueError(
            f"advantages must be [N] or [N, T] with a mask of the same shape; got advantages "
            f"{tuple(advantages.shape)} and mask {tuple(mask.shape)}"
        )
    m = mask.to(advantages.dtype)  # [N, T]
    counts = m.sum(-1)  # [N]
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"responses {empty} have no masked-in token: their mean advantage is undefined"
        )
    return ((advantages.detach() * m).sum(-1) / counts).float()  # [N]


def ucb_scores(mu: Sequence[float], counts: Sequence[int], c: float) -> list[float]:
    """UCB_j = mu_j + c * sqrt(2 ln(N + 1) / (n_j + 1)), N = sum of counts."""
    log_total = math.log(sum(counts) + 1)
    return [m + c * math.sqrt(2 * log_total / (n + 1)) for m, n in zip(mu, counts, strict=True)]


def softmax(scores: Sequence[float], temperature: float) -> list[float]:
    """softmax(scores / temperature), with the max subtracted so no exp overflows."""
    top = max(scores)
    e = [math.exp((s - top) / temperature) for s in scores]
    total = sum(e)
    return [x / total for x in e]


class DumpSampler:
    """Draws prompts source by source with DUMP's probabilities; same interface as PromptSampler.

    Call `update(sources, advantages)` after each step's advantages are known, with one source value
    and one scalar advantage per response. Its whole state (windows, counts, RNG) is in
    `state_dict()`, so a resumed run draws exactly what an uninterrupted run would have drawn.
    """

    def __init__(
        self,
        examples: list[dict],
        *,
        source_column: str,
        window: int = 300,
        c: float = 1.0,
        temperature: float = 0.1,
        seed: int = 0,
    ) -> None:
        if not examples:
            raise ValueError("the task's training split is empty: nothing to sample prompts from")
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"curriculum window must be an integer >= 1, got {window!r}")
        if not c >= 0:
            raise ValueError(f"curriculum c (UCB exploration weight) must be >= 0, got {c!r}")
        if not temperature > 0:
            raise ValueError(f"curriculum temperature must be > 0, got {temperature!r}")
        self.examples = examples
        self.source_column = source_column
        self.window, self.c, self.temperature, self.seed = window, c, temperature, seed
        self._rows: dict[Hashable, list[int]] = {}  # source -> example indices, first-seen order
        for i, ex in enumerate(examples):
            if source_column not in ex:
                raise KeyError(
                    f"curriculum source_column {source_column!r} is missing from training example "
                    f"{i}; its columns are {sorted(ex)}"
                )
            src = ex[source_column]
            if not isinstance(src, Hashable):
                raise TypeError(
                    f"example {i} has an unhashable {source_column!r} value {src!r}: sources "
                    f"must be strings or numbers"
                )
            self._rows.setdefault(src, []).append(i)
        self.sources: list[Hashable] = list(self._rows)
        self.names = [str(s) for s in self.sources]  # for metrics and checkpoints
        if len(set(self.names)) != len(self.names):
            raise ValueError(
                f"distinct {source_column!r} values print the same ({self.sources}); metric "
                f"names would collide"
            )
        self._index = {s: j for j, s in enumerate(self.sources)}
        self._windows: list[deque[float]] = [deque(maxlen=window) for _ in self.sources]
        self._counts = [0] * len(self.sources)
        self._rng = random.Random(seed)

    # ---- the bandit -------------------------------------------------------------------------

    def _mu(self) -> list[float]:
        return [sum(w) / len(w) if w else 0.0 for w in self._windows]

    def _p(self) -> list[float]:
        return softmax(ucb_scores(self._mu(), self._counts, self.c), self.temperature)

    def update(self, sources: Sequence[Hashable], advantages: Sequence[float] | Tensor) -> None:
        """Record one |advantage| per response into its source's window; n_j += responses.

        Inputs are checked in full before anything changes: a bad call leaves the state intact.
        """
        if isinstance(advantages, Tensor):
            if advantages.dim() != 1:
                raise ValueError(
                    f"update takes one advantage per response (shape [N]), got shape "
                    f"{tuple(advantages.shape)}; reduce token-level advantages with "
                    f"response_advantages(advantages, mask)"
                )
            values = [float(a) for a in advantages.detach().cpu().tolist()]
        else:
            values = [float(a) for a in advantages]
        if len(values) != len(sources):
            raise ValueError(f"update got {len(sources)} sources but {len(values)} advantages")
        unknown = sorted({str(s) for s in sources if s not in self._index})
        if unknown:
            raise ValueError(
                f"update got sources {unknown} that are not in the training data's "
                f"{self.source_column!r} column (known: {self.names})"
            )
        bad = [i for i, a in enumerate(values) if not math.isfinite(a)]
        if bad:
            raise ValueError(
                f"advantages at responses {bad} are not finite; the curriculum refuses them"
            )
        for s, a in zip(sources, values):
            j = self._index[s]
            self._windows[j].append(abs(a))
            self._counts[j] += 1

    def probabilities(self) -> dict[Hashable, float]:
        """The probability of drawing each source at the next `next` call (uniform before data)."""
        return dict(zip(self.sources, self._p()))

    def metrics(self) -> dict[str, float]:
        """Per source: curriculum/p/<s>, curriculum/mu/<s>, curriculum/ucb/<s>, curriculum/n/<s>."""
        mu = self._mu()
        ucb = ucb_scores(mu, self._counts, self.c)
        p = softmax(ucb, self.temperature)
        out: dict[str, float] = {}
        for j, name in enumerate(self.names):
            out[f"curriculum/p/{name}"] = p[j]
            out[f"curriculum/mu/{name}"] = mu[j]
            out[f"curriculum/ucb/{name}"] = ucb[j]
            out[f"curriculum/n/{name}"] = float(self._counts[j])
        return out

    # ---- the PromptSampler interface --------------------------------------------------------

    def next(self, n: int) -> list[dict]:
        """n examples: per slot a source j ~ p, then an example of j uniformly, with replacement."""
        p = self._p()  # fixed within one call: updates come between steps
        picks = range(len(self.sources))
        out = []
        for _ in range(n):
            j = self._rng.choices(picks, weights=p)[0]
            rows = self._rows[self.sources[j]]
            out.append(self.examples[rows[self._rng.randrange(len(rows))]])
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and numbers only (survives torch.save and JSON alike)."""
        version, internal, gauss = self._rng.getstate()
        return {
            "sources": list(self.names),
            "sizes": [len(self._rows[s]) for s in self.sources],
            "window": self.window,
            "windows": [list(w) for w in self._windows],
            "counts": list(self._counts),
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output; refuses (changing nothing) a state from other data."""
        sizes = [len(self._rows[s]) for s in self.sources]
        if state["sources"] != self.names or state["sizes"] != sizes:
            raise ValueError(
                f"the checkpoint's curriculum sources {state['sources']} (sizes {state['sizes']}) "
                f"differ from the task's {self.names} (sizes {sizes}): resume needs the same data"
            )
        if state["window"] != self.window:
            raise ValueError(
                f"the checkpoint's curriculum window is {state['window']}, the config's is "
                f"{self.window}: resume needs the same window"
            )
        version, internal, gauss = state["rng"]
        rng = random.Random()
        rng.setstate((version, tuple(internal), gauss))
        self._windows = [deque((float(a) for a in w), maxlen=self.window) for w in state["windows"]]
        self._counts = [int(n) for n in state["counts"]]
        self._rng = rng
