"""DistServe's evaluation workloads, rebuilt from published statistics: ``sharegpt-multiturn``, ``humaneval``, ``longbench``.

DistServe (OSDI'24) prepares its datasets with ``evaluation/2-benchmark-serving/0-prepare-dataset.py``
(facebook/opt-13b tokenizer; rules in ``workload-stats.json`` entries ``sharegpt_distserve_prep``,
``longbench_distserve_prep``). We have the rules but not the datasets, so each workload here is a
generative model of the raw data, fitted to published statistics, with the preparation rule applied
to it exactly. Lengths count OPT tokens including the one BOS the tokenizer adds per text.

``sharegpt-multiturn`` (``ShareGPTMultiTurn``). DistServe's rule: keep conversations of >= 3
messages; draw ``k ~ U{1 .. min(n - 1, 1000)}``; prompt = the first ``k`` messages joined with
``"\\n"``, output = message ``k`` (so about half the outputs are *user* messages); drop a pair if
prompt < 4 and output < 4, or prompt + output >= 2048. Joined, the prompt has one BOS and ``k - 1``
newlines where the messages had ``k`` BOS: its length is the sum of the message lengths. Since each
conversation yields at most one pair and DistServe samples its requests uniformly from the pairs,
rejection sampling conversation by conversation draws exactly DistServe's request distribution.
The raw conversations, and every statistic assumed:

| statistic | value | source / why |
|---|---|---|
| rounds (a user message and its answer) per conversation | geometric on {1, 2, ..}, mean 3.51 | ShareGPT_V3_unfiltered_cleaned_split, DistServe's file: 94,145 conversations, 330,239 turns (ShareChat, arXiv 2512.17843, Table 1). The mean is published; the geometric shape (a user goes on with a fixed probability) is assumed |
| messages per conversation | 2 x rounds | the dataset's format |
| each round's two message lengths | one draw of ``chatbot``: first message mean 228 / median 97 (fit 105) in [4, 1024]; second mean 226 / median 160 in [4, 2044] | entry ``sharegpt_v3_vllm_sampler_opt_thirdparty``: the first two messages of every conversation of the same file, OPT tokens (``simulator.lengths.SHAREGPT_OPT``) |
| rounds' lengths | independent, same distribution | assumed: no per-position statistics are published |

Why the first round stands for every round: the only per-message statistics published for this file
are of its first two messages. They already mix roles (35.5% of those conversations start with the
assistant, as the split file cuts long chats mid-dialogue) and show nearly equal means (228 vs 226),
so the roles are not modelled apart; fitting separate user and assistant lengths to them
(with the vLLM paper's 161 / 338 means, entry ``sharegpt_vllm_paper_fig11``) has no plausible
solution. What this leaves out: the 12.5% of conversations vLLM's filter dropped (a first message
over 1024 tokens, ...), so long pasted messages are missing and prompts are somewhat short; and
any correlation of lengths within a conversation. Result (``describe_sharegpt_multiturn``, 200k
draws, seed 0): prompt mean 649, p50 556, p90 1,394; output mean 212, p50 139, p90 513 —
the prompts 2.8x the first-turn ``chatbot`` prompts (mean 228), the heavier prefill load of DistServe's runs.
DistServe's own requests (``sharegpt-distserve``, below: 300 of them, recorded in its real runs' traces)
have longer prompts still (mean 780, p90 1,512) and shorter outputs (mean 176).

``humaneval``: HumanEval's 164 problems as DistServe builds them (prompt, canonical solution; none
reaches 2048 tokens), entry ``humaneval_distserve_style_computed`` — the statistics ``code`` uses.

``longbench`` (``LongBenchLengths``). DistServe's rule: context truncated to 40,000 characters, then
to ``min(2040 - answer_len, U{1900 .. 2048})`` tokens; output = ``answers[0]``, every task of the
folder, its length ``answer_len = len(tokenizer(answer).input_ids)`` — the answer's tokens plus the BOS
OPT's tokenizer adds, so no output is shorter than 2 tokens and every TPOT spans at least one decode
step (a 1-token output has no TPOT and meets any TPOT SLO). Assumed: every context is longer than that cut (LongBench's averages are 6,711 English
words / 13,386 Chinese characters, ~9k+ OPT tokens after the 40k-character cut), so prompt =
``min(2040 - output, U{1900 .. 2048})``. The answer lengths are unpublished; assumed a bounded
lognormal in [1, 1024] with mean 90 and median 15, from the task mix (21 tasks: 15 QA / few-shot /
synthetic tasks with answers of ~2-40 tokens (DuReader's longer), two code-completion tasks with
one-line answers of ~20, four summarisation tasks with reference summaries of ~90-800 tokens;
LongBench's ``dataset2maxlen`` caps of 32-512 tokens): a median answer is a short span, the mean
is carried by the summaries. The output is that answer plus its BOS.
Result (200k draws, seed 0): prompt mean 1,910, p50 1,952, p90 2,021; output mean 90, p50 16, p90 283,
min 2 (7.5% of outputs are 2 tokens: one-token answers). Until session 34 the BOS was left out of the
output, so 11% of requests had a 1-token output, no TPOT, and met any TPOT SLO.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from distserve.errors import InvalidConfigError
from simulator.lengths import (
    HUMANEVAL_OPT, LengthDistribution, LengthTarget, LogNormalLengths, ResampledLengths, chatbot_lengths, check_int,
)

__all__ = [
    "DISTSERVE_MAX_TOTAL", "DISTSERVE_TRACES", "LONGBENCH_ANSWER", "SHAREGPT_MEAN_ROUNDS", "DistServeShareGPTSample", "LongBenchLengths",
    "ShareGPTMultiTurn", "describe_sharegpt_multiturn", "humaneval_lengths",
]

DISTSERVE_TRACES = Path(__file__).resolve().parent / "data" / "distserve-opt13b-vllm-traces.json"  # its real runs' requests
DISTSERVE_MAX_TOTAL = 2048  # OPT's max_position_embeddings: DistServe keeps prompt + output < 2048
SHAREGPT_MEAN_ROUNDS = 3.51  # 330,239 turns / 94,145 conversations
LONGBENCH_ANSWER = LengthTarget(mean=90.0, median=15.0, min=1, max=1024)
_MAX_PROMPT_MESSAGES = 1000  # DistServe's --sharegpt-max-prompt-turns


class ShareGPTMultiTurn(LengthDistribution):
    """DistServe's ShareGPT preparation applied to generated conversations (see the module docstring).

    ``round_lengths`` draws one round's (first, second) message lengths; ``mean_rounds`` is the mean
    of the geometric number of rounds; ``min_messages`` and ``max_total_len`` are DistServe's filters.
    """

    def __init__(self, mean_rounds: float = SHAREGPT_MEAN_ROUNDS, round_lengths: LengthDistribution | None = None,
                 min_messages: int = 3, max_total_len: int = DISTSERVE_MAX_TOTAL):
        if isinstance(mean_rounds, bool) or not isinstance(mean_rounds, (int, float)) or not 1 <= mean_rounds < 1e6:
            raise InvalidConfigError(f"sharegpt-multiturn: mean_rounds must be a number in [1, 1e6), got {mean_rounds!r}", "mean_rounds")
        check_int("sharegpt-multiturn: min_messages", min_messages, 2, "(one prompt and one output message)")
        check_int("sharegpt-multiturn: max_total_len", max_total_len, 9, "(two messages of >= 4 tokens fit)")
        self.mean_rounds, self.min_messages, self.max_total_len = float(mean_rounds), int(min_messages), int(max_total_len)
        self.rounds = round_lengths or chatbot_lengths()
        self.name = "sharegpt-multiturn"
        self.description = (
            f"DistServe's ShareGPT preparation (>= {self.min_messages} messages, prompt = a random prefix of messages, "
            f"in + out < {self.max_total_len}) on conversations of geometric rounds (mean {self.mean_rounds:g}), "
            f"each round {self.rounds.description}"
        )

    def conversations(self, m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``m`` raw conversations: (message lengths [m, most messages], 0 past each one's end; messages of each [m])."""
        num_rounds = rng.geometric(1.0 / self.mean_rounds, m)  # [m]
        width = int(num_rounds.max())
        first, second = self.rounds.sample(m * width, rng)  # [m * width] each
        lens = np.stack([first.reshape(m, width), second.reshape(m, width)], axis=2).reshape(m, 2 * width)  # [m, 2 * width]
        lens[np.arange(2 * width)[None, :] >= 2 * num_rounds[:, None]] = 0
        return lens, 2 * num_rounds

    def _pairs(self, m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """DistServe's (prompt, output) pairs of ``m`` conversations, the dropped ones left out."""
        lens, num_messages = self.conversations(m, rng)
        kept = num_messages >= self.min_messages
        lens, num_messages = lens[kept], num_messages[kept]
        k = rng.integers(1, np.minimum(num_messages - 1, _MAX_PROMPT_MESSAGES) + 1)  # [kept] messages in the prompt
        rows = np.arange(len(k))
        prompt = np.cumsum(lens, axis=1)[rows, k - 1]  # one BOS and k - 1 newlines in place of k BOS
        output = lens[rows, k]
        ok = ~((prompt < 4) & (output < 4)) & (prompt + output < self.max_total_len)
        return prompt[ok], output[ok]

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        prompts: list[np.ndarray] = []
        outputs: list[np.ndarray] = []
        have = 0
        while have < n:
            p, o = self._pairs(max(2 * (n - have), 64), rng)
            prompts.append(p)
            outputs.append(o)
            have += len(p)
        return np.concatenate(prompts)[:n].astype(np.int64), np.concatenate(outputs)[:n].astype(np.int64)


def describe_sharegpt_multiturn(n: int = 200_000, seed: int = 0) -> dict[str, float]:
    """Mean / p50 / p90 of prompt and output of ``sharegpt-multiturn`` (the figures in the module docstring)."""
    prompt, output = ShareGPTMultiTurn().sample(n, np.random.default_rng(seed))
    out: dict[str, float] = {}
    for key, values in (("prompt", prompt), ("output", output)):
        p50, p90 = np.percentile(values, [50, 90])
        out |= {f"{key}_mean": float(values.mean()), f"{key}_p50": float(p50), f"{key}_p90": float(p90)}
    return out


def humaneval_lengths(**overrides: float) -> LogNormalLengths:
    """HumanEval as DistServe prepares it (keywords as ``PublishedLengths.build``)."""
    return HUMANEVAL_OPT.build("humaneval", **overrides)


class LongBenchLengths(LengthDistribution):
    """DistServe's LongBench preparation: prompt = ``min(cut - answer, U{min_prompt .. max_prompt})``."""

    def __init__(self, answer: LengthTarget = LONGBENCH_ANSWER, min_prompt: int = 1900, max_prompt: int = 2048, cut: int = 2040):
        check_int("longbench: min_prompt", min_prompt, 1)
        check_int("longbench: max_prompt", max_prompt, min_prompt)
        check_int("longbench: cut", cut, 3, "(one prompt token, the BOS and one answer token)")
        if answer.max is None or answer.max + 1 >= cut:
            raise InvalidConfigError(f"longbench: the answer length bound plus its BOS must be below cut={cut}, got {answer.max}", "answer")
        self.answer = LogNormalLengths(answer, answer, name="longbench-answers", source="LongBench answers (assumed)")
        self.min_prompt, self.max_prompt, self.cut = int(min_prompt), int(max_prompt), int(cut)
        self.name = "longbench"
        self.description = (
            f"DistServe's LongBench preparation: prompt = min({self.cut} - answer, U{{{self.min_prompt}..{self.max_prompt}}}), "
            f"answers lognormal mean {answer.mean:g} median {answer.median} in [{answer.min}, {answer.max}] tokens (assumed; task mix) + 1 BOS"
        )

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        answer, _ = self.answer.sample(n, rng)  # [n] the answer text's tokens
        output = answer + 1  # [n] DistServe's answer_len = len(tokenizer(answer).input_ids): OPT's tokenizer adds a BOS
        prompt = np.minimum(self.cut - output, rng.integers(self.min_prompt, self.max_prompt + 1, size=n))  # [n]
        return prompt.astype(np.int64), output


class DistServeShareGPTSample(ResampledLengths):
    """``sharegpt-distserve``: (prompt, output) pairs resampled, with replacement, from the requests DistServe itself served.

    DistServe's repository records the requests of its real OPT-13B runs (``data/distserve-opt13b-vllm-traces.json``:
    its ShareGPT preparation, OPT tokens with the BOS; every trace there is a prefix of ``vllm-300-3``): 300 draws of
    the distribution ``sharegpt-multiturn`` rebuilds from statistics. They have longer prompts (mean 780, p90 1,512 against
    649 and 1,394: the rebuilt conversations lack the long pasted messages vLLM's filter dropped) and shorter outputs
    (mean 176 against 212). 300 draws hold the distribution's bulk, not its far tail.
    """

    def __init__(self, trace: str = "vllm-300-3"):
        data = json.loads(DISTSERVE_TRACES.read_text())
        if trace not in data["traces"]:
            raise InvalidConfigError(f"sharegpt-distserve: trace must be one of {sorted(data['traces'])}, got {trace!r}", "trace")
        rows = data["traces"][trace]
        col = data["fields"].index
        prompt = np.array([r[col("prompt_len")] for r in rows], dtype=np.int64)  # [num_requests]
        output = np.maximum(1, np.array([r[col("output_len")] for r in rows], dtype=np.int64))  # [num_requests]
        super().__init__(prompt, output, "sharegpt-distserve",
                         f"the {len(rows)} requests of DistServe's real OPT-13B runs (its ShareGPT preparation; {trace}), "
                         f"resampled: prompt mean {prompt.mean():.0f}, output mean {output.mean():.0f}")
