"""SQuAD pretraining (causal LM for GPT-2, masked LM for BERT) with DDP, and its profiler capture.

data.py     SQuAD JSON, local tokenizers, CLM/MLM batches
loop.py     one rank's training (DDP, accumulation, eval, checkpoints) and the capture around it
options.py  the command line shared by `syntorch train` and `python -m syntorch.train` (torchrun)
"""
