"""compressed-tensors' matching rules: a target is a module class name, an exact module name, or `re:<regex>`
matched from the start of the module name."""
import re

from torch import nn


def matches(name: str, module: nn.Module, patterns: list[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or pattern == type(module).__name__ or (pattern == "Linear" and isinstance(module, nn.Linear)):
            return True
    return False


def select(modules: dict[str, nn.Module], targets: list[str], ignore: list[str]) -> dict[str, nn.Module]:
    return {
        name: module
        for name, module in modules.items()
        if matches(name, module, targets) and not matches(name, module, ignore)
    }
