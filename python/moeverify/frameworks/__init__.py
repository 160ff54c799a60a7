"""Adapters that run an installed framework's own MoE code on exported case
folders and write what it computes under moeverify's stage names
(docs/frameworks.md): `python -m moeverify.frameworks.torchtitan CASE_DIR`,
`python -m moeverify.frameworks.megatron CASE_DIR`, or either with --serve as
a `moeverify fuzz --impl ... --worker`."""
