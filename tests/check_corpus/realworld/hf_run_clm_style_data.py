"""Hugging Face run_clm.py's data shape: load_dataset on every rank (the datasets cache takes a file
lock, so the ranks do not race), tokenization under `training_args.main_process_first()`, and a
torchvision data set downloaded inside `accelerator.main_process_first()`.

    torchrun --nproc_per_node=8 hf_run_clm_style_data.py --dataset_name wikitext
"""
from accelerate import Accelerator
from datasets import load_dataset
from torchvision import datasets
from transformers import AutoTokenizer, HfArgumentParser, Trainer, TrainingArguments


def tokenize_all(raw, tokenizer, training_args):
    column = raw["train"].column_names[0]
    with training_args.main_process_first(desc="dataset map tokenization"):
        return raw.map(lambda batch: tokenizer(batch[column]), batched=True, remove_columns=[column])


def probe_images(accelerator, root):
    with accelerator.main_process_first():
        return datasets.CIFAR10(root, train=False, download=True)


def main():
    parser = HfArgumentParser(TrainingArguments)
    (training_args,) = parser.parse_args_into_dataclasses()
    raw = load_dataset("wikitext", "wikitext-2-raw-v1")
    tokenizer = AutoTokenizer.from_pretrained("gpt2")
    tokenized = tokenize_all(raw, tokenizer, training_args)
    probe = probe_images(Accelerator(), "data")
    trainer = Trainer(args=training_args, train_dataset=tokenized["train"], tokenizer=tokenizer)
    trainer.train()
    return len(probe)


if __name__ == "__main__":
    main()
