"""The implementation of `sf.init` (shardfn/init.py is the public namespace).

  initializers.py  `Initializer`, its constructors (normal, uniform, kaiming_uniform, ...), `Param`
  describe.py      checking a description, drawing values by row blocks, `materialize`
  modules.py       `from_module`, `torch_default`: an nn.Module's own rules or PyTorch's defaults
  record.py        recording a transformers model's `_init_weights` (the torch.nn.init calls it makes)
  rules.py         recorded writes -> an initializer per parameter, a value per buffer
  buffers.py       `materialize_buffers`: computed buffers (rotary inv_freq) of a meta-device module
"""
