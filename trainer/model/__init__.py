"""The model: building it from the configuration (:mod:`.build`), the transformers families
(:mod:`.family`), the loss (:mod:`.loss`), LoRA adapters (:mod:`.lora`) and the tokenizer files
written beside an export (:mod:`.hf_tokenizer`)."""
