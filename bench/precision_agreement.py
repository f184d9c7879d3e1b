"""How close int8 weight-only, bf16 and fp16 stay to fp32 on GPT-2-shaped random models, by weight scale.

    python bench/precision_agreement.py [--layers 4] [--positions 64]

For each initialisation, the fp32 model's greedy continuation of a random prompt is fed to every variant
(teacher forcing) and the share of positions whose argmax equals fp32's and the logits' relative L2 error
are printed. Initialisations: GPT-2's 0.02 everywhere (flat logits: argmax ties flip), the token embedding (so
the tied head) at 0.3 with the layers at 0.02 (what tests/inference/test_precision.py asserts on), and every weight at
0.3 or 0.1 (attention scores grow with the square of the scale: at 0.3 softmax is a hard argmax that any
rounding re-routes, so even fp16 loses positions).
"""
import argparse
import dataclasses

import torch

from syntorch.config import get_config
from syntorch.generate import Sampling, generate
from syntorch.models import build_model
from syntorch.models.layers import init_weights
from syntorch.quant import quantize_int8_weight_only

INITS = {"all 0.02": (0.02, 0.02), "embedding 0.3, layers 0.02": (0.3, 0.02), "all 0.1": (0.1, 0.1),
         "all 0.3": (0.3, 0.3)}


def model_at(n_layer: int, embedding_std: float, std: float):
    config = dataclasses.replace(get_config("gpt2"), n_layer=n_layer)
    torch.manual_seed(0)
    model = build_model(config)
    init_weights(model, std=std, residual_layers=n_layer)
    torch.nn.init.normal_(model.tok_emb.weight, std=embedding_std)
    return model.eval()


def variants(n_layer: int, embedding_std: float, std: float) -> dict:
    int8 = model_at(n_layer, embedding_std, std)
    quantize_int8_weight_only(int8)
    return {"int8 w/o": int8, "bf16": model_at(n_layer, embedding_std, std).to(torch.bfloat16),
            "fp16": model_at(n_layer, embedding_std, std).to(torch.float16)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--positions", type=int, default=64)
    args = parser.parse_args()
    prompt = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(1))
    print(f"GPT-2-shaped, {args.layers} layers, {args.positions} positions after an 8-token prompt (teacher forced)")
    for label, stds in INITS.items():
        fp32 = model_at(args.layers, *stds)
        with torch.inference_mode():
            tokens = generate(fp32, prompt, args.positions, Sampling(temperature=0)).tokens
            ids = torch.tensor(tokens)
            want = fp32(ids)[0, prompt.shape[1] - 1:-1]
            cells = []
            for name, model in variants(args.layers, *stds).items():
                got = model(ids)[0, prompt.shape[1] - 1:-1].float()
                agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
                cells.append(f"{name} {agree:6.1%} (rel err {(got - want).norm() / want.norm():6.2%})")
        print(f"  {label:27s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
