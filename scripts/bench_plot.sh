# Sourced by scripts/bench.sh --plot DIR: sweeps the swap and storage figures over block size and
# rank count, writes them as whitespace-separated tables (DIR/swap.dat, DIR/storage.dat) and
# draws them with gnuplot as DIR/swap.png and DIR/storage.png. Expects with_daemons, $kvtd,
# $loadgen and $KVTD_BUILD_DIR from bench.sh. KVTD_BENCH_QUICK=1 shortens every run (for the
# test that checks the pictures are drawn; its figures mean nothing).
plot_dir=$1
mkdir -p "$plot_dir"
quick=${KVTD_BENCH_QUICK:-0}
swap_seconds=3 storage_objects=512
[ "$quick" = 1 ] && swap_seconds=0.3 storage_objects=64

# Block sizes by KV heads (64 tokens x 128 head dim x bf16 = 16 KiB per head, per layer and tensor).
echo "== plot: swap throughput by block size (per layer and tensor) and ranks, next to memcpy"
echo "# block_kib ranks swap_gbs_per_rank memcpy_gbs" > "$plot_dir/swap.dat"
for heads in 1 2 4 8 16; do
  for ranks in 1 2; do
    line=$(with_daemons "$ranks" 32 "$heads" 64 128 64 48 -- --mode throughput --blocks-per-task 16 \
      --seconds "$swap_seconds")
    echo "$line"
    echo "$line" | sed -n "s/.*swap \([0-9.]*\) GB\/s per rank.*plain memcpy \([0-9.]*\) GB\/s.*/$((heads * 16)) $ranks \1 \2/p" \
      >> "$plot_dir/swap.dat"
  done
done

echo "== plot: storage tasks through the daemons (file store) by object size and ranks, next to the store alone and the HiCacheFile peer"
echo "# object_kib ranks write_gbs_per_rank read_gbs_per_rank store_put_gbs store_get_gbs peer_put_gbs peer_get_gbs" \
  > "$plot_dir/storage.dat"
pdir=$(mktemp -d "$KVTD_ROOT/.bench-plot.XXXXXX")  # on the project's disk, like a local SSD tier
for heads in 1 4 16; do
  object=$((heads * 16 * 8 * 2))  # KiB: 8 layers x K+V
  alone=$("$KVTD_BUILD_DIR/tools/storage_bench/kvtd-storage-bench" --backend file --dir "$pdir/alone" \
    --object-bytes $((object * 1024)) --batches $((storage_objects / 32)) | head -n 1)
  rm -rf "$pdir/alone"
  put=$(echo "$alone" | sed -n 's/.*put \([0-9.]*\) GB\/s.*/\1/p') get=$(echo "$alone" | sed -n 's/.*get \([0-9.]*\) GB\/s.*/\1/p')
  peer_put=nan peer_get=nan
  if /usr/bin/python3 -c "import numpy" 2>/dev/null; then
    peer=$(/usr/bin/python3 "$KVTD_ROOT/tools/bench/hicache_file_peer.py" --dir "$pdir" --objects "$storage_objects" \
      --object-mib "$(awk "BEGIN {print $object / 1024}")")
    peer_put=$(echo "$peer" | sed -n 's/.*put \([0-9.]*\) GB\/s.*/\1/p') peer_get=$(echo "$peer" | sed -n 's/.*get \([0-9.]*\) GB\/s.*/\1/p')
  fi
  for ranks in 1 2; do
    rm -rf "$pdir/daemon"
    daemon_extra=(--storage-backend file --storage-path "$pdir/daemon" --model-id plot)
    line=$(with_daemons "$ranks" 8 "$heads" 64 128 128 8 -- --mode storage-throughput --storage file \
      --blocks-per-task 32 --storage-blocks "$storage_objects")
    echo "$line"
    w=$(echo "$line" | sed -n 's/.*STORAGE_WRITE \([0-9.]*\) GB\/s per rank.*/\1/p')
    r=$(echo "$line" | sed -n 's/.*STORAGE_READ \([0-9.]*\) GB\/s per rank.*/\1/p')
    echo "$object $ranks $w $r $put $get $peer_put $peer_get" >> "$plot_dir/storage.dat"
  done
done
daemon_extra=()
rm -rf "$pdir"

host="$(nproc) cores, $(uname -m), host backend (no GPU: memory-to-memory copies)"
gnuplot <<GNUPLOT
set terminal pngcairo size 900,540 font ",10" noenhanced
set key left top
set grid
set yrange [0:*]
set logscale x 2
set xlabel "block size per layer and tensor (KiB)"
set ylabel "GB/s per rank"
set output "$plot_dir/swap.png"
set title "kvtd swap throughput, 32 layers x K+V, 16 random blocks per task\n$host"
plot "$plot_dir/swap.dat" every 2::0 using 1:3 with linespoints lw 2 title "kvtd, 1 rank", \
     "" every 2::1 using 1:3 with linespoints lw 2 title "kvtd, 2 ranks (per rank)", \
     "" every 2::0 using 1:4 with linespoints dt 2 title "plain memcpy, same bytes"
set output "$plot_dir/storage.png"
set xlabel "object size (KiB)"
set ylabel "GB/s per rank"
set title "kvtd storage tasks through the daemons (file store), next to the store alone and sglang's HiCacheFile mechanism\n$host"
plot "$plot_dir/storage.dat" every 2::0 using 1:3 with linespoints lw 2 title "kvtd STORAGE_WRITE, 1 rank", \
     "" every 2::0 using 1:4 with linespoints lw 2 title "kvtd STORAGE_READ, 1 rank", \
     "" every 2::1 using 1:3 with linespoints title "kvtd STORAGE_WRITE, 2 ranks (per rank)", \
     "" every 2::1 using 1:4 with linespoints title "kvtd STORAGE_READ, 2 ranks (per rank)", \
     "" every 2::0 using 1:5 with linespoints dt 2 title "file store alone, put", \
     "" every 2::0 using 1:6 with linespoints dt 2 title "file store alone, get", \
     "" every 2::0 using 1:7 with linespoints dt 3 title "HiCacheFile peer, put", \
     "" every 2::0 using 1:8 with linespoints dt 3 title "HiCacheFile peer, get"
GNUPLOT
echo "plots: $plot_dir/swap.png $plot_dir/storage.png (tables: swap.dat, storage.dat)"
