"""Integrations of Zellige with model libraries (optional extras).

- `zellige.integrations.diffusers`: a diffusers transformer trained under a Zellige step,
  unedited (`pip install zellige[diffusers]`; docs/diffusers.md).
"""
