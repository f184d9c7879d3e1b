"""`syntorch infer` as a library: InferenceSpec (what to run), RunOutputs (what to write), run_inference."""
from syntorch.inference.outputs import RunOutputs, write_run_outputs
from syntorch.inference.run import run_inference, tp_inference_rank
from syntorch.inference.spec import (InferenceSpec, decode, encode, generate_tokens, load_model, make_prompt,
                                     resolve_config, run_model, run_record, sampling_of, write_run_json)

__all__ = ["InferenceSpec", "RunOutputs", "decode", "encode", "generate_tokens", "load_model", "make_prompt",
           "resolve_config", "run_inference", "run_model", "run_record", "sampling_of", "tp_inference_rank",
           "write_run_json", "write_run_outputs"]
