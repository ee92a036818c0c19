"""The implementation of `sf.init` (shardfn/init.py is the public namespace).

  initializers.py  `Initializer`, its constructors (normal, uniform, kaiming_uniform, ...), `Param`
  describe.py      checking a description, drawing values by row blocks, `materialize`
  modules.py       `from_module`, `torch_default`: an nn.Module's defaults
"""
