"""The speculative core, whatever the drafter: the processed target distribution and sampling (`sampling`), lossless
verification (`verify`), the adaptive controller and the whole-step gate (`adaptive`), and acceptance statistics
(`stats`). It imports nothing above `models/`.
"""
