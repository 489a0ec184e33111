"""The rule language: parse (safe YAML with line numbers), schema, match, plan (`ktinject.rules.plan`)."""
from .model import PhaseChoice, Rule, RuleSet
from .parse import load_rules, pack_names, resolve

__all__ = ["PhaseChoice", "Rule", "RuleSet", "load_rules", "pack_names", "resolve"]
