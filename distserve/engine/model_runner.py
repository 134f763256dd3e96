"""Executes a ``StepPlan`` on torch: owns the model shard, its KV cache tensors and per-request RNG state.

Every worker of an instance runs the same plan. With pipeline parallelism, stages after the first
receive hidden states from the previous stage and all but the last send theirs on; only the
driver (TP rank 0 of the last stage) samples and returns tokens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distserve.config import ModelConfig
from distserve.dtypes import torch_dtype
from distserve.engine.model import LlamaForCausalLM, prepack_linears
from distserve.engine.parallel import ParallelState
from distserve.engine.shard import ShardSpec
from distserve.engine.logprobs import PromptLogprobsBuilder
from distserve.engine.sampler import Sampler
from distserve.engine.step_plan import SampledToken, ScheduledChunk, StepPlan, fork_rows
from kernels.backends import decode_attention_for, default_decode_attention
from kernels.paged_attention import AttentionMetadata


SLOW_LAYER_S = 0.3  # a ``slow`` step fault's extra time per layer


@dataclass(eq=False)
class LayerPass:
    """A plan part-way through the model's layers (``ModelRunner.begin``, resumed by ``run``)."""

    plan: StepPlan
    x: torch.Tensor | None = None  # [T, hidden]: the next layer's input; None once done (or nothing to compute)
    cos: torch.Tensor | None = None  # rope tables for the plan's positions
    sin: torch.Tensor | None = None
    meta: AttentionMetadata | None = None
    sample_rows: list[int] = field(default_factory=list)
    next_layer: int = 0
    slow_s: float = 0.0  # test hook (``inject_step_fault(..., "slow")``): extra seconds per layer


class ModelRunner:
    """Runs the model over a packed batch and samples one token per finished chunk."""

    def __init__(
        self,
        config: ModelConfig,
        state_dict: dict[str, torch.Tensor],
        num_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...] = (),
        device: str = "cpu",
        prepack_weights: bool = True,
        parallel: ParallelState | None = None,
        decode_attention: str | None = None,
    ) -> None:
        """``decode_attention`` names a ``kernels.decode_attention`` backend (default: the device's)."""
        self.config = config
        self.parallel = parallel or ParallelState(ShardSpec())
        shard = self.parallel.shard
        self.device = torch.device(device)
        self.dtype = torch_dtype(config.dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.decode_attention = decode_attention or default_decode_attention(self.device)
        decode_attention_for(self.decode_attention, self.device)  # fail here, not at every step: unknown, or not for this device
        self.eos_token_ids = eos_token_ids
        model = LlamaForCausalLM(config, shard, self.parallel.all_reduce)
        model.load_hf_state_dict(state_dict)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.model.rotary.float()  # keep the rope tables in fp32 whatever the weights' dtype
        self.num_prepacked = prepack_linears(self.model) if prepack_weights and self.device.type == "cpu" else 0
        num_layers = model.layer_end - model.layer_start
        k0, k1 = shard.kv_heads(config)
        # [local_layers, 2, num_blocks, block_size, local_kv_heads, head_dim] (the KVLayout of
        # distserve.kvtransfer); zeroed so masked slots are finite.
        self.kv_cache = torch.zeros(
            (num_layers, 2, num_blocks, block_size, k1 - k0, config.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        self._prompt_logprobs = PromptLogprobsBuilder()
        self.step_faults: dict[str, str] = {}  # test hook: request id -> "raise" | "exit" (see inject_step_fault)

    def inject_step_fault(self, seq_id: str, kind: str = "raise") -> None:
        """Test hook: every plan computing ``seq_id`` fails — ``raise`` an exception, or ``exit`` the
        process at once (a hard crash) — as a request that trips a bug in the model would; or is
        ``slow``: run a layer at a time (``run``), each of its layers takes ``SLOW_LAYER_S`` more."""
        if kind not in ("raise", "exit", "slow"):
            raise ValueError(f"unknown step fault {kind!r}; choose raise, exit or slow")
        self.step_faults[seq_id] = kind

    def _trip_step_faults(self, plan: StepPlan) -> float:
        """Raise or exit for a faulty request of ``plan``; else the extra seconds per layer (``slow``)."""
        extra = 0.0
        for chunk in plan.chunks:
            kind = self.step_faults.get(chunk.seq_id)
            if kind == "slow":
                extra = SLOW_LAYER_S
            if kind == "exit":
                os._exit(70)
            if kind == "raise":
                raise RuntimeError(f"injected step fault computing {chunk.seq_id}")
        return extra

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Packed inputs: token ids [T], positions [T], attention metadata, and rows to sample."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            start = chunk.start_pos
            input_ids.extend(chunk.token_ids)
            pos = range(start, start + n)
            positions.extend(pos)
            table = chunk.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table)
            if chunk.sample:
                sample_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(query_lens, context_lens, slots, tables, bs, self.device, self.decode_attention)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return ids, pos_t, meta, sample_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[SampledToken]:
        shard = self.parallel.shard
        if shard.is_first_stage and shard.is_last_stage:
            done = self.run(self.begin(plan))
            assert done is not None
            return done
        self._forget(plan.finished_seq_ids)
        self.copy_blocks(plan.block_copies)
        if not plan.chunks:
            return []
        if self.step_faults:
            self._trip_step_faults(plan)
        ids, positions, meta, sample_rows = self.prepare(plan)
        prev = None
        if not shard.is_first_stage:
            prev = self.parallel.recv_from_prev_stage((ids.shape[0], self.config.hidden_size), self.dtype)
        hidden = self.model(positions, self.kv_caches, meta, input_ids=ids, hidden=prev)  # [T, hidden]
        if not shard.is_last_stage:
            self.parallel.send_to_next_stage(hidden)
            return []
        return self._sample_rows(plan, hidden, sample_rows)

    # ---- a plan one layer at a time (one pipeline stage: pp = 1) ---------------------------------
    @torch.inference_mode()
    def begin(self, plan: StepPlan) -> LayerPass:
        """Start ``plan``: its block copies, inputs and embeddings; ``run`` computes its layers."""
        shard = self.parallel.shard
        assert shard.is_first_stage and shard.is_last_stage, "a plan runs layer by layer with pp = 1 only"
        self._forget(plan.finished_seq_ids)
        self.copy_blocks(plan.block_copies)
        if not plan.chunks:
            return LayerPass(plan)
        slow_s = self._trip_step_faults(plan) if self.step_faults else 0.0
        ids, positions, meta, sample_rows = self.prepare(plan)
        x, cos, sin = self.model.start(positions, input_ids=ids)
        return LayerPass(plan, x, cos, sin, meta, sample_rows, slow_s=slow_s)

    @torch.inference_mode()
    def run(self, p: LayerPass, should_yield: Callable[[], bool] | None = None) -> list[SampledToken] | None:
        """Compute ``p``'s remaining layers; its sampled tokens, or None if ``should_yield`` (asked
        after each layer but the last) said to stop, with ``p`` ready to resume where it stopped."""
        if p.x is None:
            return []
        layers, kv_caches = self.model.layers, self.kv_caches
        while p.next_layer < len(layers):
            i = p.next_layer
            p.x = layers[i](p.x, p.cos, p.sin, kv_caches[i], p.meta)
            p.next_layer = i + 1
            if p.slow_s:
                time.sleep(p.slow_s)
            if should_yield is not None and p.next_layer < len(layers) and should_yield():
                return None
        hidden = self.model.finish(p.x)  # [T, hidden]
        p.x = None
        return self._sample_rows(p.plan, hidden, p.sample_rows)

    def _sample_rows(self, plan: StepPlan, hidden: torch.Tensor, sample_rows: list[int]) -> list[SampledToken]:
        """The tokens of ``plan``'s sampling chunks from their rows of ``hidden`` (``[T, hidden]``), on the driver."""
        if not self.parallel.shard.is_driver:
            return []
        if any(c.history is not None and c.sampling.prompt_logprobs is not None for c in plan.chunks):
            self._gather_prompt_logprobs(plan, hidden)
        if not sample_rows:
            return []
        logits = self.model.compute_logits(hidden[sample_rows])  # [N, V]
        chunks = [c for c in plan.chunks if c.sample]
        if plan.forks:  # n > 1: each completion samples from its leader's row
            rows, chunks = fork_rows(chunks, plan.forks)
            logits = logits[rows]  # [N + forks, V]
        try:
            return self._sample(logits, chunks)
        except Exception:  # noqa: BLE001 - one request's failure is its own: sample each row alone to find it
            sampled: list[SampledToken] = []
            for i, chunk in enumerate(chunks):
                try:
                    sampled.extend(self._sample(logits[i : i + 1], [chunk]))
                except Exception as exc:  # noqa: BLE001 - reported to this request only
                    sampled.append(SampledToken(chunk.seq_id, -1, None, f"sampling failed: {type(exc).__name__}: {exc}"))
            return sampled

    def _gather_prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Prompt logprobs from the rows of ``hidden`` (``[T, hidden]``) of each chunk that computes
        part of a prompt whose request asked for them (before its first token only)."""
        offset = 0
        for c in plan.chunks:
            n = len(c.token_ids)
            k = c.sampling.prompt_logprobs
            if k is not None and c.history is not None and not c.num_output_tokens:
                targets = c.history[c.start_pos + 1 : c.start_pos + n + 1]  # the prompt tokens these rows predict
                self._prompt_logprobs.add_chunk(c.seq_id, c.start_pos, hidden[offset : offset + len(targets)],
                                                targets, k, self.model.compute_logits)
            offset += n

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        """One token per row of ``logits`` (``[N, V]``), row i for ``chunks[i]``."""
        out = self.sampler(
            logits,
            [c.sampling for c in chunks],
            [self._generator(c) for c in chunks],
            [c.num_output_tokens for c in chunks],
            self.eos_token_ids,
            [c.history for c in chunks],
            [c.token_bitmask for c in chunks],
        )
        tokens = [SampledToken(c.seq_id, tok) for c, tok in zip(chunks, out.token_ids)]
        for i, (c, token) in enumerate(zip(chunks, tokens)):
            sp = c.sampling
            if sp.logprobs and out.logprobs is not None:
                token.logprob = out.logprobs[i]
                if sp.top_logprobs and out.top_logprobs is not None:
                    token.top_logprobs = out.top_logprobs[i]
            if sp.prompt_logprobs is not None and not c.num_output_tokens:
                token.prompt_logprobs = self._prompt_logprobs.pop(c.seq_id)
        return tokens

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator | None:
        """The chunk's request's generator: seeded, and advanced past the draws of the tokens it
        already has when it is new here (a decode instance after migration, a re-run), so a seeded
        request gets the same tokens wherever each of them is sampled."""
        seed = chunk.sampling.seed
        if seed is None:
            return None
        gen = self._generators.get(chunk.seq_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            if not chunk.sampling.greedy:
                for _ in range(chunk.num_output_tokens):  # one draw per sampled token (``sampler._uniforms``)
                    torch.rand(1, dtype=torch.float64, generator=gen)
            self._generators[chunk.seq_id] = gen
        return gen

    def _forget(self, seq_ids: list[str]) -> None:
        """Drop the per-request state of finished requests."""
        for seq_id in seq_ids:
            self._generators.pop(seq_id, None)
        self._prompt_logprobs.discard(seq_ids)
