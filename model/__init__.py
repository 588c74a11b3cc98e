"""The decoder-only language model: `from model import LMConfig, CausalLM`."""

from model.model import CausalLM, CausalLMOutput, LMConfig

__all__ = ["CausalLM", "CausalLMOutput", "LMConfig"]
