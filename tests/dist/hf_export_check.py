"""An exported Hugging Face directory, checked against the run it came from: transformers loads it
with no missing, unexpected or mismatched tensors; it generates; and the loss it computes on the
batch of step STEP + 1 (the weights of checkpoint STEP are those that step trained from) next to
the loss the run recorded there. Prints JSON.

megatron-core's loss is a softmax over the padded vocabulary (the padding rows of the output layer
take part), transformers' over the real one: given a megatron checkpoint, the padding rows are
read from it and "padded_loss" is the loss megatron-core computes from the exported weights.

    python hf_export_check.py RUN_DIR HF_DIR STEP [MEGATRON_CHECKPOINT]
"""

import json
import sys
from pathlib import Path

import torch


def output_rows(checkpoint: str) -> torch.Tensor:
    """The output layer of a megatron-core dist checkpoint with its padding rows, whole (read by
    torch.distributed.checkpoint alone: that tensor and nothing else)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(checkpoint)
    stored = reader.read_metadata().state_dict_metadata
    key = "output_layer.weight" if "output_layer.weight" in stored else "embedding.word_embeddings.weight"
    rows = {key: torch.empty(stored[key].size, dtype=stored[key].properties.dtype)}
    dcp.load(rows, storage_reader=reader, no_dist=True)
    return rows[key]


def main():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.plan.layout import resolve
    from toolkit.train.data import build_datasets, micro_batches
    from toolkit.train.deepspeed_engine import token_loss
    from toolkit.config.store import load_run_config

    run_dir, hf_dir, step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    model.eval()
    out = {k: sorted(map(str, v)) for k, v in info.items() if k != "error_msgs"}
    out["dtype"] = str(next(model.parameters()).dtype)

    prompt = torch.tensor([[15496, 995]])  # "Hello world" in GPT-2 BPE
    if Path(hf_dir, "tokenizer.json").exists():
        prompt = AutoTokenizer.from_pretrained(hf_dir)("And God said", return_tensors="pt")["input_ids"]
    generated = model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    out["generated_tokens"] = generated.shape[1] - prompt.shape[1]

    cfg = load_run_config(run_dir)
    layout = resolve(cfg)
    if cfg.data.name != "synthetic":  # GPTDataset's builder runs collectives: a world of one
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    dataset = build_datasets(cfg, layout).train
    padded = output_rows(sys.argv[4]) if len(sys.argv) > 4 else None
    losses, padded_losses = [], []
    with torch.no_grad():
        for dp_rank in range(layout.dp):
            batches = micro_batches(dataset, layout, dp_rank, start_step=step, workers=0)
            for _ in range(layout.grad_accum):
                batch = next(batches)
                inputs = dict(input_ids=batch["tokens"], position_ids=batch["position_ids"])
                if padded is None:
                    logits = model(**inputs).logits
                else:  # the exported lm_head is the first vocab_size rows of `padded`
                    hidden = model.base_model(**inputs).last_hidden_state  # after the final norm
                    padded_logits = hidden @ padded.t()
                    logits = padded_logits[..., : model.config.vocab_size]
                    padded_losses.append(token_loss(padded_logits, batch["labels"], batch["loss_mask"]).item())
                losses.append(token_loss(logits, batch["labels"], batch["loss_mask"]).item())
    out["loss"] = sum(losses) / len(losses)
    if padded is not None:
        out["padded_loss"] = sum(padded_losses) / len(padded_losses)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out["recorded_loss"] = next(r["loss"] for r in records if r["step"] == step + 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
