#!/usr/bin/env bash
# Megatron arguments of the CPU demo model and run (printed on one line; used by the demo, tests, bench).
echo --num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 \
  --seq-length ${SEQ_LENGTH:-4096} --max-position-embeddings ${SEQ_LENGTH:-4096} \
  --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights \
  --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 1 --global-batch-size ${GBS:-16} \
  --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 \
  --seed ${SEED:-1234} --tokenizer-type NullTokenizer --vocab-size 257 \
  --calculate-per-token-loss --use-distributed-optimizer --use-cpu-initialization \
  --log-interval 1 --eval-iters 0 --eval-interval 1000000 --ckpt-format torch --no-gradient-accumulation-fusion \
  --transformer-impl local \
  --no-rope-fusion --no-masked-softmax-fusion --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-persist-layer-norm
