"""Heavy engines behind the project's two interfaces (policy and generator): Megatron-Core, vLLM, Ray.

Each backend imports its dependency lazily and names the pip extra to install when it is missing; nothing under
`megatron_spec.models|engine|spec|rl|sim|tasks` imports from here.
"""
