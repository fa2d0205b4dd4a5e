"""Language models trained from scratch: Titans (MAC/MAG/MAL/LMM), Mela, the MLP-FFN LM."""
