"""One model's engine: requests, scheduler, model runner, attention, sampler, detokenizer."""
