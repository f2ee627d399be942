"""The cross-field rules of pre-flight validation, by concern; `pretrain.validate.validate` runs them.

Each rule is `rule(report, cfg, layout_or_None, te_on_gpu)` and adds problems to the report.
"""
