"""What prefill and decode share: model, weights, paged KV cache, scheduler, runner, sampler, colocated engine."""
