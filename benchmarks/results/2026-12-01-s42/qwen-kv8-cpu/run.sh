set -x
cd /work/main
V=.venv/bin/vllm-mixprec
O=${O:-/tmp/kv8q}
Q=qwen2.5-coder-1.5b
E="--text lcet10 botchan --tokens 4096 --window 1024"
t0=$SECONDS
$V eval $Q $E --json $O/bf16.json > $O/bf16.log 2>&1; echo "bf16 $((SECONDS-t0)) s"
$V eval $Q $E --kv kv8 --json $O/kv8.json > $O/kv8.log 2>&1; echo "kv8 $((SECONDS-t0)) s"
$V quantize $Q $O/sakc --scheme none --k-centering --smooth-attention --calib-samples 8 --calib-seqlen 512 > $O/quant.log 2>&1; echo "quant $((SECONDS-t0)) s"
$V eval $O/sakc $E --kv kv8 --json $O/sakc-kv8.json > $O/sakc-kv8.log 2>&1; echo "sakc-kv8 $((SECONDS-t0)) s"
$V eval $O/sakc $E --json $O/sakc.json > $O/sakc.log 2>&1; echo "sakc $((SECONDS-t0)) s"
$V eval $Q $E --kv kv8 --kv-bias-aware --json $O/kv8-ba.json > $O/kv8-ba.log 2>&1; echo "kv8-ba $((SECONDS-t0)) s"
echo ALLDONE
