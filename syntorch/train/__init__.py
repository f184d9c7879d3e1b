"""SQuAD pretraining (causal LM for GPT-2, masked LM for BERT) on a parallel plan, and its profiler capture.

data.py     SQuAD JSON, local tokenizers, CLM/MLM batches
loop.py     one rank's training (accumulation, eval, checkpoints) and the capture around it
planned.py  the plan of the options, its micro-batches, losses over the mesh, checkpoints
options.py  the command line shared by `syntorch train` and `python -m syntorch.train` (torchrun)
"""
