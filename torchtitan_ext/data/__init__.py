"""Data: datasets and the dataloader, tokenizers, the embedded corpus, synthetic tasks and task rows, Locas' documents."""
