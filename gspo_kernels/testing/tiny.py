"""A tiny random Llama, a word-level tokenizer and a GRPOTrainer around them, built offline:
shared by the TRL drop-in's tests and its benchmark (nothing is downloaded)."""

from __future__ import annotations

PAD, EOS, UNK, BOS = 60, 61, 62, 63  # the tokenizer's 64 words: t0..t59 and these


def tiny_tokenizer(words: list[str] | None = None):
    """A whitespace word-level tokenizer: `words` (default t0..t59) get ids 0.., then <pad>,
    <eos>, <unk>, <bos> (ids 60..63 for the default words)."""
    import tokenizers
    import transformers

    words = [f"t{i}" for i in range(60)] if words is None else list(words)
    specials = ("<pad>", "<eos>", "<unk>", "<bos>")
    vocab = {w: i for i, w in enumerate(words + list(specials))}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>", bos_token="<bos>")


def tiny_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, seed: int = 0, words: int = 60, tied: bool = False):
    """A random Llama; `words` is how many plain words the tokenizer has before its specials;
    tied: the lm_head shares the input embedding's weight."""
    import torch
    import transformers

    pad, eos, bos = words, words + 1, words + 3
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=1024, pad_token_id=pad, eos_token_id=eos,
                                      bos_token_id=bos, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config)


def tiny_transformed_logits_model(kind: str, seed: int = 0):
    """A random model with tiny_llama's sizes and ids whose logits are transformed after the
    head: "cohere" multiplies them by logit_scale = 0.3, "granite" divides them by
    logits_scaling = 0.25, "gemma2" soft-caps them at final_logit_softcapping = 0.5."""
    import torch
    import transformers

    torch.manual_seed(seed)
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=PAD, eos_token_id=EOS,
                 bos_token_id=BOS)
    if kind == "cohere":
        return transformers.CohereForCausalLM(transformers.CohereConfig(logit_scale=0.3, **sizes))
    if kind == "granite":
        return transformers.GraniteForCausalLM(transformers.GraniteConfig(logits_scaling=0.25, **sizes))
    if kind == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(final_logit_softcapping=0.5, head_dim=8,
                                                                        **sizes))
    raise ValueError(f"unknown kind {kind!r}: cohere, granite or gemma2")


def tiny_grpo_trainer(trainer_cls, model, output_dir: str, config_cls=None, rollout_func=None, **overrides):
    """trainer_cls (TRL's GRPOTrainer or the drop-in) on CPU in float32 (TRL's CPU default is
    bf16 autocast), 4 prompts a step in groups of 2, a reward that counts characters.
    config_cls: the arguments' class (default trl.GRPOConfig; the drop-in's GRPOConfig for its
    own options). rollout_func: TRL's custom generation hook, or None."""
    import datasets
    import trl

    settings = dict(output_dir=output_dir, per_device_train_batch_size=4, num_generations=2, max_completion_length=5,
                    report_to=[], use_cpu=True, logging_steps=1, max_steps=1, save_strategy="no", bf16=False)
    settings.update(overrides)
    prompts = datasets.Dataset.from_dict({"prompt": ["t1 t2 t3", "t4 t5", "t6 t7 t8 t9"] * 4})

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    config_cls = trl.GRPOConfig if config_cls is None else config_cls
    extra = {} if rollout_func is None else {"rollout_func": rollout_func}
    return trainer_cls(model=model, reward_funcs=reward, args=config_cls(**settings), train_dataset=prompts,
                       processing_class=tiny_tokenizer(), **extra)
