"""Train the small LoRA adapter that ships with lora-serve: SmolLM2-135M-Instruct answering like a pirate.

    PYTHONPATH=. python examples/train_pirate_adapter.py            # about 3 minutes on 2 CPU cores
    PYTHONPATH=. python examples/train_pirate_adapter.py --out /tmp/pirate --steps 300

The data is made here, offline: templated questions (capitals, sums, colours, opposites) in the model's chat
template, each answered as "Arr, matey! <the answer, in pirate words> Savvy?". The loss covers the answer tokens
only. PEFT LoRA, rank 8 on q, k, v and o, trained in bf16 autocast on CPU with AdamW; the adapter is saved with
PEFT's save_pretrained (adapter_config.json and adapter_model.safetensors, float32, about 3.7 MB) to
examples/adapters/pirate, where serve_config.yaml's adapters root picks it up after `.ci/install.sh` copies it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import default_cache_dir
from engine.model_files import resolve_model

CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
            "Greece": "Athens", "Portugal": "Lisbon", "Poland": "Warsaw", "Austria": "Vienna", "Chile": "Santiago",
            "Cuba": "Havana", "Ireland": "Dublin", "Sweden": "Stockholm", "Finland": "Helsinki", "China": "Beijing",
            "Russia": "Moscow", "India": "New Delhi", "Mexico": "Mexico City", "Argentina": "Buenos Aires",
            "Thailand": "Bangkok", "Turkey": "Ankara", "Denmark": "Copenhagen", "Belgium": "Brussels"}
COLOURS = {"the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
           "a tomato": "red", "an orange": "orange", "the sea": "blue"}
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow", "day": "night", "wet": "dry",
             "old": "young", "light": "dark"}


def examples(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """(question, pirate answer) pairs."""
    makers = [
        lambda: (lambda c: (f"What is the capital of {c}?", f"The capital of {c} be {CAPITALS[c]}, me hearty."))(
            rng.choice(list(CAPITALS))),
        lambda: (lambda a, b: (f"What is {a} + {b}?", f"{a} plus {b} be {a + b} pieces o' eight."))(
            rng.randint(1, 20), rng.randint(1, 20)),
        lambda: (lambda t: (f"What colour is {t}?", f"{t[0].upper() + t[1:]} be {COLOURS[t]}, like the Jolly "
                                                     f"Roger's flag be black."))(rng.choice(list(COLOURS))),
        lambda: (lambda w: (f"What is the opposite of {w}?", f"The opposite o' {w} be {OPPOSITES[w]}, ye landlubber."))(
            rng.choice(list(OPPOSITES))),
    ]
    pairs = [rng.choice(makers)() for _ in range(n)]
    return [(q, f"Arr, matey! {a} Savvy?") for q, a in pairs]


def encode(tokenizer, question: str, answer: str) -> tuple[list[int], list[int]]:
    """Token ids of the whole chat, and labels that leave the prompt out (-100)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer(prompt).input_ids
    answer_ids = tokenizer(answer + tokenizer.eos_token).input_ids
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def batch(tokenizer, pairs: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    encoded = [encode(tokenizer, q, a) for q, a in pairs]
    width = max(len(ids) for ids, _ in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in encoded])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in encoded])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in encoded])
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int) -> None:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    path = resolve_model("smollm2-135m-instruct", default_cache_dir() / "models")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    with tqdm(range(steps), desc="train pirate adapter") as bar:
        for _ in bar:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch(tokenizer, examples(rng, batch_size))).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.save_pretrained(out)
    _portable(out)
    print(f"saved to {out}")


def _portable(out: Path) -> None:
    """Name the base model by its Hub id rather than this machine's cache path; drop PEFT's model card."""
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "README.md").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "adapters" / "pirate")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.out, args.steps, args.batch_size, args.lr, args.seed)


if __name__ == "__main__":
    main()
