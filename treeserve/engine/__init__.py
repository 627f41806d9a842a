"""One model's engine: requests in, one step at a time, outputs out. A step's stages and their files:

    add_request -> Request/Sequence ............ request.py (validation.py checks first)
    schedule    -> [ScheduledSeq], page copies .. scheduler.py (+ kv/page_manager.py)
    prepare     -> PreparedStep(StepPlan, rows) . input_batch.py   (contract: step_plan.py)
    launched    -> progress counted, in flight .. postprocess.py
    run         -> StepResult ................... device_queue.py -> model_runner.py (contract: step_result.py)
                   forward, sample, read-outs ... attention.py, sampler.py, dedup.py, cuda_graphs.py
    read        -> tokens, stops, forks, outputs  postprocess.py (+ detokenizer.py)

`llm_engine.py` runs them plainly or overlapped (launch step t+1, then read back step t); `DeviceQueue`
owns launch order and the fences on pages handed between engines.
"""
