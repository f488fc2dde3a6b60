import torch

from drlcli.metrics import AccuracyReport, accuracy_report, most_confused, summarize_history


def test_accuracy_report_groups_and_old_new():
    class_stage = torch.tensor([1, 1, 2, 2])
    targets = torch.tensor([0, 1, 2, 3, 0, 2])
    preds = torch.tensor([0, 0, 2, 3, 0, 3])
    report = accuracy_report(preds, targets, class_stage, num_stages=2)
    assert report.top1 == round(100 * 4 / 6, 4)
    assert report.groups == {"1": round(100 * 2 / 3, 4), "2": round(100 * 2 / 3, 4)}
    assert report.old == report.groups["1"] and report.new == report.groups["2"]
    assert report.num_images == 6


def test_history_average_last_and_forgetting():
    reports = [
        AccuracyReport(top1=90.0, num_images=10, groups={"1": 90.0}),
        AccuracyReport(top1=80.0, num_images=20, groups={"1": 85.0, "2": 75.0}),
        None,  # a stage evaluated on nothing
        AccuracyReport(top1=70.0, num_images=30, groups={"1": 60.0, "2": 80.0, "4": 70.0}),
    ]
    summary = summarize_history(reports)
    assert summary.accuracy == [90.0, 80.0, None, 70.0]
    assert summary.average == 80.0
    assert summary.last == 70.0
    assert summary.forgetting == {"1": 30.0, "2": -5.0}


def test_accuracy_matrix_and_mean_forgetting():
    reports = [
        AccuracyReport(top1=90.0, num_images=10, groups={"1": 90.0}),
        None,
        AccuracyReport(top1=70.0, num_images=30, groups={"1": 60.0, "2": 80.0, "3": 70.0}),
    ]
    summary = summarize_history(reports)
    assert summary.matrix == [[90.0, None, None], [None, None, None], [60.0, 80.0, 70.0]]
    assert summary.forgetting == {"1": 30.0}  # group 2 has no earlier accuracy
    assert summary.mean_forgetting == 30.0
    assert summarize_history([reports[0]]).mean_forgetting is None


def test_most_confused_pairs_by_count_then_name():
    names = ["cat", "dog", "fox"]
    targets = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    preds = torch.tensor([1, 1, 0, 0, 2, 0, 0, 2])
    assert most_confused(preds, targets, names, top=3) == [
        {"true": "cat", "predicted": "dog", "count": 2},
        {"true": "fox", "predicted": "cat", "count": 2},
        {"true": "dog", "predicted": "cat", "count": 1},
    ]
    assert most_confused(targets, targets, names) == []
    assert len(most_confused(preds, targets, names, top=0)) == 0


def test_top5_counts_a_target_among_the_five_best_classes():
    targets = torch.tensor([0, 1, 2, 3])
    ranked = torch.tensor([[0, 9, 8, 7, 6], [9, 8, 7, 6, 1], [9, 8, 7, 6, 5], [3, 0, 1, 2, 4]])
    stage = torch.tensor([1] * 10)
    report = accuracy_report(ranked[:, 0], targets, stage, num_stages=1, ranked=ranked)
    assert report.top1 == 50.0 and report.top5 == 75.0
    assert accuracy_report(ranked[:, 0], targets, stage, num_stages=1).top5 is None


def test_leave_one_out_nearest_mean_leaves_each_image_out_of_its_own_mean():
    from drlcli.metrics import leave_one_out_right

    x = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0], [0.9, 0.2]])
    labels = torch.tensor([0, 0, 1, 1, 1])  # the last image lies among class 0's
    assert leave_one_out_right(x, labels).tolist() == [True, True, True, True, False]
    # one image of a class: without it, its class has no mean (scored 0), so it is never right
    assert leave_one_out_right(
        torch.tensor([[1.0, 0.2], [0.0, 1.0], [0.0, 0.9]]), torch.tensor([0, 1, 1])
    ).tolist() == [
        False,
        True,
        True,
    ]


def test_a_stage_of_one_class_says_its_forward_transfer_was_not_measured():
    from drlcli.cli.render import transfer_line
    from drlcli.metrics import Transfer

    run = Transfer(320, 63, 5316)
    line = transfer_line(Transfer(0, 0, 0).record(run))
    assert line.startswith(
        "forward transfer: not measured at this stage (it compares the stage's own classes; it has one)"
    )
    assert "run so far +4.8 % of 5316 images: adapting transfers to new classes here" in line
    assert "of this stage's 12 images" in transfer_line(Transfer(3, 1, 12).record(run))


def test_forward_transfer_counts_and_what_they_say():
    import pytest

    from drlcli.metrics import Transfer, measure

    g = torch.Generator().manual_seed(0)
    labels = torch.arange(4).repeat_interleave(25)
    separated = torch.nn.functional.one_hot(labels, 8).float() + 0.3 * torch.randn(100, 8, generator=g)
    mixed = torch.randn(100, 8, generator=g)
    t = measure(separated, mixed, labels)
    assert t.images == 100 and t.better > 50 and t.worse < 10 and t.transfers and t.gain >= 40
    assert measure(separated, separated, labels) == Transfer(0, 0, 100)
    assert not Transfer(0, 0, 100).transfers
    assert measure(separated[:25], mixed[:25], labels[:25]) == Transfer(0, 0, 0)  # one class: nothing to compare
    assert not Transfer(3, 0, 1590).transfers  # above chance (3 > 1.645 √3), but 0.19 % of the images: too small
    assert Transfer(13, 3, 310).transfers and not Transfer(20, 11, 319).transfers  # 3.2 %; 2.8 % within chance
    assert Transfer(20, 11, 319) + Transfer(18, 5, 286) == Transfer(38, 16, 605)
    assert Transfer.from_dict(Transfer(1, 2, 5).to_dict()) == Transfer(1, 2, 5)
    for bad in (
        None,
        [],
        {"better": 1, "worse": 1},
        {"better": 4, "worse": 2, "images": 5},
        {"better": -1, "worse": 0, "images": 5},
        {"better": True, "worse": 0, "images": 5},
        {"better": 1.0, "worse": 0, "images": 5},
    ):
        with pytest.raises(ValueError):
            Transfer.from_dict(bad)
